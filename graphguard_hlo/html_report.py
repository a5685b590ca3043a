"""``--html OUT.html``: the verdict and the sequential graph around the failure, in one file.

The text report names the failing op; this page shows where it sits: the ops that
lead to it, which of them earned a relation (green), the one that did not (red) and
what could not be checked after it (grey).  Hovering a node shows its relations and
its ``file:line``.

The file must open anywhere (a CI artifact, a mail attachment) with no network and no
JavaScript, so the graph is inline SVG laid out here: the windows drawn are small
(~25 ops), for which a plain layered (Sugiyama-style) layout is enough and a layout
library would be a dependency for nothing.
"""

from __future__ import annotations

import dataclasses
import html

from graphguard_hlo import ir
from graphguard_hlo.errors import InputError
from graphguard_hlo.passes.inference import RelationInference, Result, _live_ops

WINDOW = 25        # ops drawn before the failing op (or before the outputs)
AFTER = 5          # unchecked ops drawn after the failing op: what it blocks
CHAR_W, NODE_H = 7.4, 40   # 12px monospace: px per character; node box height
H_GAP, V_GAP, MARGIN = 24, 36, 16
DUMMY_W = 8        # a long edge passes through one invisible node per layer it crosses
MAX_LABEL = 44


@dataclasses.dataclass(eq=False)
class _Node:
  kind: str                 # proved | failed | unproved | input | output | dummy
  lines: tuple[str, ...]    # the label, one entry per text line
  title: str = ""           # hover text
  layer: int = 0
  x: float = 0.0            # centre
  preds: list["_Node"] = dataclasses.field(default_factory=list)
  succs: list["_Node"] = dataclasses.field(default_factory=list)

  @property
  def w(self) -> float:
    if self.kind == "dummy":
      return DUMMY_W
    return max(len(s) for s in self.lines) * CHAR_W + 20


def write_html(path: str, result: Result, seq_graph: ir.Graph, inference: RelationInference,
               seq_path: str, dist_path: str) -> None:
  """Write the report; an unwritable path is the user's input error, on one line."""
  page = render_html(result, seq_graph, inference, seq_path, dist_path)
  try:
    with open(path, "w", encoding="utf-8") as f:
      f.write(page)
  except OSError as e:
    raise InputError(path, f"cannot write the HTML report: {e.strerror}") from None


def render_html(result: Result, seq_graph: ir.Graph, inference: RelationInference,
                seq_path: str, dist_path: str) -> str:
  graph = getattr(seq_graph, "main", seq_graph)  # a Module is accepted too
  e = _esc
  verdict = "refines" if result.refines else "not proved"
  body = [f'<h1><span class="verdict {"ok" if result.refines else "bad"}">{e(verdict)}</span> '
          f'<code>{e(dist_path)}</code> {"refines" if result.refines else "is not proved to refine"} '
          f'<code>{e(seq_path)}</code></h1>']
  f = result.failure
  if f is not None:
    what = (f"output {f.output_index} is not rebuilt by a clean expression"
            if f.output_index is not None else
            f"'{f.op_name}' has no relation to the distributed program")
    rows = "".join(f"<tr><td><code>{e(name)}</code></td><td>"
                   + "<br>".join(f"<code>~ {e(r)}</code>" for r in rels or ["(no relation)"])
                   + "</td></tr>" for name, rels in f.inputs)
    table = f"<table><tr><th>operand</th><th>its relations</th></tr>{rows}</table>" if rows else ""
    body.append(f'<div class="failure"><p class="where"><code>{e(str(f.location))}</code>: '
                f'error: {e(what)}</p><p><b>diagnosis:</b> {e(f.diagnosis)}</p>{table}</div>')
  if result.outputs:
    items = "".join(f"<li><code>output {o.index} = {e(o.relation)}</code></li>"
                    for o in result.outputs)
    body.append(f'<div class="outputs"><b>outputs</b><ul>{items}</ul></div>')
  s = result.stats
  if s:
    body.append(f'<p class="stats">{s.get("seq_ops_checked", 0)} sequential ops checked '
                f'against {s.get("dist_ops", 0)} per-device ops, mesh {e(str(s.get("mesh")))}</p>')
  nodes, edges, caption = _graph_window(result, graph, inference)
  body.append(f'<h2>{e(caption)}</h2>'
              '<p class="legend"><span class="sw proved"></span>related to the distributed '
              'program <span class="sw failed"></span>failing <span class="sw unproved"></span>'
              'not checked <span class="sw input"></span>input to this window '
              '&mdash; hover a node for its relations and <code>file:line</code></p>')
  body.append(f'<div class="graph">{_svg(nodes, edges)}</div>')
  return _PAGE.format(title=e(f"gg-hlo-verify: {verdict}: {dist_path}"), body="\n".join(body))


# -- which ops, and what each one is ---------------------------------------------

def _failing(result: Result, inf: RelationInference, live: list[ir.Op]):
  """The op the verdict blames, found as ``run()`` found it: the first live op with an
  unrelated result.  An output failure blames the output, whose producer is related."""
  f = result.failure
  if f is None or f.output_index is not None:
    return None
  return next((op for op in live if not _related(op, inf)), None)


def _blocked(failing: ir.Op, later: list[ir.Op]) -> list[ir.Op]:
  """The first few ops that read the failing op's results, directly or not: what the
  failure leaves unchecked.  Later ops that do not depend on it would only add clutter."""
  tainted = {r.id for r in failing.results}
  out = []
  for op in later:
    if len(out) == AFTER:
      break
    if any(v.id in tainted for v in op.operands):
      out.append(op)
      tainted.update(r.id for r in op.results)
  return out


def _related(op: ir.Op, inf: RelationInference) -> bool:
  return all(r.id in inf.splats or inf.relations.get(r.id) for r in op.results)


def _graph_window(result: Result, graph: ir.Graph, inf: RelationInference):
  live_ids = _live_ops(graph)
  live = [op for op in graph.ops if id(op) in live_ids]
  failing = _failing(result, inf, live)
  f = result.failure
  bad_output = f.output_index if f is not None else None
  if failing is not None:
    k = live.index(failing)
    ops = live[max(0, k - WINDOW):k + 1] + _blocked(failing, live[k + 1:])
    caption = f"the failing {failing.name}, the {min(k, WINDOW)} ops before it and what it blocks"
  else:
    anchor = graph.results[bad_output].producer if bad_output is not None else None
    k = live.index(anchor) + 1 if anchor in live else len(live)
    ops = live[max(0, k - WINDOW):k]
    caption = f"the last {len(ops)} ops before the outputs"

  in_window = {id(op) for op in ops}
  nodes: list[_Node] = []
  by_value: dict[int, _Node] = {}   # value id -> node that produces it in the drawing

  def source(v: ir.Value) -> _Node:
    if v.id not in by_value:
      by_value[v.id] = _add(nodes, _Node("input", _input_label(v, graph),
                                         _title(v, inf, graph)))
    return by_value[v.id]

  for op in ops:
    kind = "failed" if op is failing else "proved" if _related(op, inf) else "unproved"
    res = op.results[0] if op.results else None
    more = f" +{len(op.results) - 1}" if len(op.results) > 1 else ""
    lines = (op.name, f"%{res.id} {res.type}{more}" if res else "(no result)")
    title = _op_title(op, inf, kind, f if op is failing else None)
    preds = [source(v) for v in op.operands]  # first, so nodes stay in topological order
    node = _add(nodes, _Node(kind, lines, title))
    for p in preds:
      _link(p, node)
    for r in op.results:
      by_value[r.id] = node
  for i, v in enumerate(graph.results):
    if v.producer is None or id(v.producer) in in_window:
      failed = bad_output == i
      kind = "failed" if failed else "output" if (failing is None) else "unproved"
      rel = next((o.relation for o in result.outputs if o.index == i), None)
      title = f"output {i}: {v.type}\n" + (f"= {rel}" if rel else "not proved")
      if failed:
        title += f"\ndiagnosis: {f.diagnosis}\nat {f.location}"
      _link(source(v), _add(nodes, _Node(kind, (f"output {i}", str(v.type)), title)))
  return nodes, _layout(nodes) if nodes else [], caption


def _input_label(v: ir.Value, graph: ir.Graph) -> tuple[str, str]:
  if v.producer is not None:
    return (f"%{v.id} {v.producer.name}", str(v.type))
  i = next((k for k, p in enumerate(graph.params) if p is v), None)
  loc = graph.param_locations[i].op_name if i is not None and i < len(
      graph.param_locations) else None
  name = f"%{v.name or v.id}" + (f" ({loc})" if loc else "")
  return (name, str(v.type))


def _title(v: ir.Value, inf: RelationInference, graph: ir.Graph) -> str:
  where = f"\n{v.producer.location}" if v.producer is not None else ""
  rels = inf.describe(v)
  return (f"{' '.join(_input_label(v, graph))}{where}\n"
          + ("\n".join(f"~ {r}" for r in rels) if rels else "(no relation)"))


def _op_title(op: ir.Op, inf: RelationInference, kind: str, failure) -> str:
  head = ", ".join(f"%{r.id}" for r in op.results)
  args = ", ".join(f"%{v.id}" for v in op.operands)
  lines = [f"{head} = {op.name}({args})", str(op.location)]
  if kind == "failed":
    lines.append("FAILING: no relation to the distributed program")
  for r in op.results:
    rels = inf.describe(r)
    lines += [f"~ {x}" for x in rels] or ["(no relation)" if kind == "failed" else
                                          "(not checked: after the failure)"]
  if failure is not None:
    lines.append(f"diagnosis: {failure.diagnosis}")
  return "\n".join(lines)


def _add(nodes: list[_Node], node: _Node) -> _Node:
  node.lines = tuple(s if len(s) <= MAX_LABEL else s[:MAX_LABEL - 1] + "\u2026"
                     for s in node.lines)
  nodes.append(node)
  return node


def _link(a: _Node, b: _Node) -> None:
  if b in a.succs:  # two results of one op feeding one op: one edge
    return
  a.succs.append(b)
  b.preds.append(a)


# -- layered layout ----------------------------------------------------------------

def _layout(nodes: list[_Node]) -> list[list[_Node]]:
  """Layers, order within layers, x positions; returns each edge as its chain of nodes.

  Layer = longest path from the window's inputs; a node with slack (an input, a
  broadcast of a bias) then moves down to just above its first consumer, so edges stay
  short.  Edges longer than one layer get a dummy node per layer crossed, so they are
  ordered and placed like nodes and never run through a box."""
  for n in nodes:  # nodes are in topological order
    n.layer = max((p.layer + 1 for p in n.preds), default=0)
  for n in reversed(nodes):
    if n.succs:
      n.layer = min(s.layer for s in n.succs) - 1
  chains = []
  for a in list(nodes):
    for b in list(a.succs):
      chain = [a]
      for layer in range(a.layer + 1, b.layer):
        d = _Node("dummy", ("",), layer=layer)
        nodes.append(d)
        chain.append(d)
      chain.append(b)
      if len(chain) > 2:
        a.succs[a.succs.index(b)] = chain[1]
        b.preds[b.preds.index(a)] = chain[-2]
        for u, v in zip(chain, chain[1:]):
          if u.kind == "dummy":
            u.succs.append(v)
          if v.kind == "dummy":
            v.preds.append(u)
      chains.append(chain)
  layers: dict[int, list[_Node]] = {}
  for n in nodes:
    layers.setdefault(n.layer, []).append(n)
  rows = [layers[k] for k in sorted(layers)]
  _order(rows)
  _place(rows)
  return chains


def _order(rows: list[list[_Node]]) -> None:
  """Barycentre sweeps: sort each layer by the mean position of its neighbours in the
  layer above (going down) or below (going up), which removes most crossings."""
  pos = {id(n): i for row in rows for i, n in enumerate(row)}
  for sweep in range(6):
    down = sweep % 2 == 0
    for row in (rows if down else rows[::-1]):
      def key(n):
        nb = n.preds if down else n.succs
        return sum(pos[id(m)] for m in nb) / len(nb) if nb else pos[id(n)]
      row.sort(key=key)
      pos.update((id(n), i) for i, n in enumerate(row))


def _place(rows: list[list[_Node]]) -> None:
  """Put each node under (or over) the mean of its neighbours, as close as the order and
  the gaps allow: pack left-to-right and right-to-left towards the wish and take the
  mean of the two, which keeps every gap and leans neither way."""
  for row in rows:
    x = 0.0
    for n in row:
      n.x = x + n.w / 2
      x += n.w + H_GAP
  for sweep in range(8):
    down = sweep % 2 == 0
    for row in (rows if down else rows[::-1]):
      want = []
      for n in row:
        nb = (n.preds if down else n.succs) or (n.succs if down else n.preds)
        want.append(sum(m.x for m in nb) / len(nb) if nb else n.x)
      gap = [(a.w + b.w) / 2 + H_GAP for a, b in zip(row, row[1:])]
      left = want[:]
      for i in range(1, len(row)):
        left[i] = max(want[i], left[i - 1] + gap[i - 1])
      right = want[:]
      for i in range(len(row) - 2, -1, -1):
        right[i] = min(want[i], right[i + 1] - gap[i])
      for n, a, b in zip(row, left, right):
        n.x = (a + b) / 2
  lo = min(n.x - n.w / 2 for row in rows for n in row)
  for row in rows:
    for n in row:
      n.x += MARGIN - lo


# -- drawing -----------------------------------------------------------------------

def _y(n: _Node) -> float:
  return MARGIN + n.layer * (NODE_H + V_GAP)


def _svg(nodes: list[_Node], chains: list[list[_Node]]) -> str:
  if not nodes:
    return "<p>(no ops to draw)</p>"
  width = max(n.x + n.w / 2 for n in nodes) + MARGIN
  height = max(_y(n) for n in nodes) + NODE_H + MARGIN
  out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height:.0f}" '
         f'viewBox="0 0 {width:.0f} {height:.0f}" role="img">'
         '<defs><marker id="arrow" viewBox="0 0 10 10" refX="10" refY="5" markerWidth="7" '
         'markerHeight="7" orient="auto-start-reverse"><path d="M0,0 L10,5 L0,10 z" '
         'fill="#78909c"/></marker><marker id="arrow-bad" viewBox="0 0 10 10" refX="10" '
         'refY="5" markerWidth="7" markerHeight="7" orient="auto-start-reverse">'
         '<path d="M0,0 L10,5 L0,10 z" fill="#c62828"/></marker></defs>']
  for chain in chains:
    pts = [(chain[0].x, _y(chain[0]) + NODE_H)]
    for d in chain[1:-1]:
      pts += [(d.x, _y(d)), (d.x, _y(d) + NODE_H)]
    pts.append((chain[-1].x, _y(chain[-1])))
    path = f"M{pts[0][0]:.1f},{pts[0][1]:.1f}"
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
      ym = (y0 + y1) / 2
      path += f" C{x0:.1f},{ym:.1f} {x1:.1f},{ym:.1f} {x1:.1f},{y1:.1f}"
    bad = chain[-1].kind == "failed"
    out.append(f'<path class="edge{" bad" if bad else ""}" d="{path}" '
               f'marker-end="url(#{"arrow-bad" if bad else "arrow"})"/>')
  for n in nodes:
    if n.kind == "dummy":
      continue
    x, y = n.x - n.w / 2, _y(n)
    rx = NODE_H / 2 if n.kind in ("input", "output") else 8
    text = "".join(f'<tspan x="{n.x:.1f}" dy="{"0" if i == 0 else "1.25em"}">{_esc(s)}</tspan>'
                   for i, s in enumerate(n.lines))
    ty = y + NODE_H / 2 - (len(n.lines) - 1) * 7.5 + 4
    out.append(f'<g class="node {n.kind}"><title>{_esc(n.title)}</title>'
               f'<rect x="{x:.1f}" y="{y:.1f}" width="{n.w:.1f}" height="{NODE_H}" '
               f'rx="{rx:.0f}"/><text x="{n.x:.1f}" y="{ty:.1f}">{text}</text></g>')
  out.append("</svg>")
  return "".join(out)


def _esc(s: str) -> str:
  return html.escape(str(s), quote=True)


_PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{title}</title>
<style>
body {{ font: 14px/1.45 system-ui, "DejaVu Sans", sans-serif; margin: 16px 24px; color: #212121; }}
h1 {{ font-size: 18px; font-weight: normal; }} h2 {{ font-size: 15px; margin: 18px 0 4px; }}
code {{ font-family: "DejaVu Sans Mono", monospace; font-size: 12.5px; }}
.verdict {{ display: inline-block; padding: 2px 10px; border-radius: 4px; color: #fff;
  font-weight: bold; text-transform: uppercase; }}
.verdict.ok {{ background: #2e7d32; }} .verdict.bad {{ background: #b71c1c; }}
.failure {{ border-left: 4px solid #b71c1c; background: #fff5f5; padding: 4px 12px; }}
.failure table {{ border-collapse: collapse; margin-bottom: 8px; }}
.failure td, .failure th {{ text-align: left; padding: 2px 12px 2px 0; vertical-align: top; }}
.outputs ul {{ margin: 2px 0; }} .stats, .legend {{ color: #616161; }}
.sw {{ display: inline-block; width: 14px; height: 10px; border: 2px solid; border-radius: 3px;
  margin: 0 4px 0 12px; vertical-align: middle; }}
.graph {{ overflow: auto; }}
svg text {{ font: 12px "DejaVu Sans Mono", monospace; text-anchor: middle; fill: #212121; }}
.edge {{ fill: none; stroke: #90a4ae; stroke-width: 1.5; }} .edge.bad {{ stroke: #c62828; }}
.node rect, .sw {{ stroke-width: 2; }}
.proved rect, .sw.proved {{ fill: #e8f5e9; stroke: #2e7d32; background: #e8f5e9; border-color: #2e7d32; }}
.failed rect, .sw.failed {{ fill: #ffcdd2; stroke: #c62828; stroke-width: 3; background: #ffcdd2; border-color: #c62828; }}
.unproved rect, .sw.unproved {{ fill: #eeeeee; stroke: #9e9e9e; background: #eeeeee; border-color: #9e9e9e; }}
.unproved text {{ fill: #757575; }}
.input rect, .sw.input {{ fill: #ffffff; stroke: #546e7a; stroke-dasharray: 4 3; background: #fff; border-color: #546e7a; border-style: dashed; }}
.output rect {{ fill: #ffffff; stroke: #2e7d32; }}
.node:hover rect {{ stroke-width: 4; }}
</style></head>
<body>
{body}
</body></html>
"""

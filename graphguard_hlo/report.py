"""Verdicts for people (compiler-style text) and for programs (JSON)."""

from __future__ import annotations

import json

from graphguard_hlo.passes.inference import Result


def to_text(result: Result, seq_path: str, dist_path: str) -> str:
  lines = []
  if result.refines:
    lines.append(f"{dist_path}: refines {seq_path}")
    for o in result.outputs:
      lines.append(f"  output {o.index} = {o.relation}")
  else:
    f = result.failure
    assert f is not None
    what = (f"output {f.output_index} is not rebuilt by a clean expression"
            if f.output_index is not None else
            f"'{f.op_name}' has no relation to the distributed program")
    lines.append(f"{f.location}: error: {what}")
    lines.append(f"  diagnosis: {f.diagnosis}")
    for operand, rels in f.inputs:
      lines.append(f"  {operand}")
      for r in rels or ["(no relation)"]:
        lines.append(f"      ~ {r}")
    if f.seq_context:
      lines.append("  sequential ops:")
      lines.extend(f"    {c}" for c in f.seq_context)
    if f.dist_context:
      lines.append("  per-device ops reading the related values:")
      lines.extend(f"    {c}" for c in f.dist_context)
    for o in result.outputs:
      lines.append(f"  output {o.index} = {o.relation}")
    lines.append(f"{dist_path}: not proved to refine {seq_path}")
  s = result.stats
  opaque = list(dict.fromkeys(s.get("opaque_ops", [])))
  for note in opaque[:10]:
    lines.append(f"  note: unsupported op treated as opaque (related only on whole replicas): "
                 f"{note}")
  if len(opaque) > 10:
    lines.append(f"  note: ... and {len(opaque) - 10} more opaque ops")
  undeclared = s.get("undeclared_outputs") or []
  if result.refines and undeclared:
    lines.append(f"  note: DIST declares no sharding for output(s) "
                 f"{', '.join(map(str, undeclared))} (an HLO text dump records none): each is "
                 "proved laid out as shown above, not checked against the sharding you asked "
                 "for")
  if s:
    lines.append(f"  ({s.get('seq_ops_checked', 0)} sequential ops checked against "
                 f"{s.get('dist_ops', 0)} per-device ops, mesh {s.get('mesh')})")
  return "\n".join(lines)


def relation_check_text(check) -> str:
  """``--check-relations``' line (``relation_check.RelationCheck``); on a
  failure, the first few relations that do not hold."""
  if check.skipped:
    return f"  relation check: skipped ({check.skipped})"
  counts = (f"{check.checked} relations, {check.classes_checked} e-classes and "
            f"{check.zeros_checked} known zeros held against numbers (rtol {check.rtol:g})"
            + (f"; {check.unknown} on values the interpreter could not compute"
               if check.unknown else ""))
  if check.ok:
    return f"  relation check: {counts}: all hold"
  lines = [f"  relation check: {len(check.failures)} FAIL of {counts}:"]
  lines.extend(f"    {failure}" for failure in check.failures[:5])
  if len(check.failures) > 5:
    lines.append(f"    ... and {len(check.failures) - 5} more")
  return "\n".join(lines)


def to_json(result: Result) -> str:
  doc = result.to_json()
  doc["notes"] = [f"opaque: {o}" for o in dict.fromkeys(result.stats.get("opaque_ops", []))]
  check = result.relation_check
  if check is not None:
    if result.withdrawn:
      doc["verdict"] = "withdrawn"
    doc["relation_check"] = {"ok": check.ok, "skipped": check.skipped, "checked": check.checked,
                             "classes_checked": check.classes_checked,
                             "zeros_checked": check.zeros_checked, "unknown": check.unknown,
                             "rtol": check.rtol, "failures": list(check.failures)}
  return json.dumps(doc, indent=2)

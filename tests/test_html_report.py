"""``--html``: one self-contained page whose graph marks the failing op, checked as
markup and, when chromium is installed, as pixels in a real browser."""

import html
import os
import re
import shutil
import struct
import subprocess
import xml.etree.ElementTree as ET
import zlib

import pytest

from graphguard_hlo import cli, html_report
from graphguard_hlo.loaders import load_module
from graphguard_hlo.passes.inference import RelationInference
from graphguard_hlo.pipeline import prepare_dist, prepare_seq

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TD = os.path.join(REPO, "testdata")
SVG = "{http://www.w3.org/2000/svg}"
MISSING, OK, OUTPUT_BUG = ("tp_mlp__shard_map__missing_allreduce", "tp_mlp__shard_map__ok",
                           "dp_loss__shard_map__psum_not_pmean")
BODY_MARGIN_X = 24  # the page's CSS body margin: where the SVG starts on screen


def _pair(name):
  return os.path.join(TD, name, "seq.mlir"), os.path.join(TD, name, "dist.mlir")


def _cli_report(tmp_path, capsys, name):
  out = tmp_path / f"{name}.html"
  code = cli.main([*_pair(name), "--html", str(out)])
  stdout, _ = capsys.readouterr()
  return code, stdout, out.read_text(encoding="utf-8")


def _nodes(page):
  """(classes, title, rect attributes) of every node of the page's SVG."""
  svg = ET.fromstring(re.search(r"<svg.*</svg>", page, re.S).group(0))
  out = []
  for g in svg.iter(f"{SVG}g"):
    cls = g.get("class", "").split()
    if "node" in cls:
      rect = {k: float(v) for k, v in g.find(f"{SVG}rect").attrib.items() if k != "rx"}
      out.append((cls, g.find(f"{SVG}title").text, rect))
  return out


def test_failing_pair_marks_the_failing_op(tmp_path, capsys):
  code, stdout, page = _cli_report(tmp_path, capsys, MISSING)
  assert code == 1 and "error: 'add' has no relation" in stdout  # usual output still printed
  assert "NOT PROVED" in page.upper() and "&#x27;add&#x27; has no relation" in page
  assert "missing all-reduce" in page and "sum[tp](%dot_general.16@r)" in page
  nodes = _nodes(page)
  failed = [n for n in nodes if "failed" in n[0]]
  assert len(failed) == 1
  title = failed[0][1]
  # (the line is testdata's, as tools.gen_testdata last wrote it)
  assert title.startswith("%14 = add(%11, %16)") and "tools/zoo/cases.py:138" in title
  assert "missing all-reduce" in title
  proved = [t for c, t, _ in nodes if "proved" in c]
  assert any("sum[tp](%dot_general.16@r) [dot-general]" in t for t in proved)  # relation on hover
  assert all(re.search(r"cases\.py:\d+", t) for t in proved)  # and file:line


def test_proved_pair_has_no_failing_node(tmp_path, capsys):
  code, _, page = _cli_report(tmp_path, capsys, OK)
  assert code == 0 and "<svg" in page and ">refines<" in page
  nodes = _nodes(page)
  kinds = {c[1] for c, _, _ in nodes}
  assert "failed" not in kinds and "proved" in kinds
  assert all("~ " in t for c, t, _ in nodes if "proved" in c)  # every op shows its relations
  out = [t for c, t, _ in nodes if "output" in c]
  assert len(out) == 1 and "replica(out0@r)" in out[0]


def test_output_failure_marks_the_output(tmp_path, capsys):
  code, _, page = _cli_report(tmp_path, capsys, OUTPUT_BUG)
  assert code == 1
  failed = [t for c, t, _ in _nodes(page) if "failed" in c]
  assert len(failed) == 1 and failed[0].startswith("output 0") and "psum where pmean" in failed[0]


@pytest.mark.parametrize("name", sorted(os.listdir(TD)))
def test_boxes_never_overlap(tmp_path, capsys, name):
  dist = [f for f in os.listdir(os.path.join(TD, name)) if f.startswith("dist.")][0]
  out = tmp_path / "r.html"
  cli.main([os.path.join(TD, name, "seq.mlir"), os.path.join(TD, name, dist), "--html", str(out)])
  capsys.readouterr()
  rects = [r for _, _, r in _nodes(out.read_text())]
  assert len(rects) >= 5
  for i, a in enumerate(rects):
    for b in rects[i + 1:]:
      apart = (a["x"] + a["width"] <= b["x"] or b["x"] + b["width"] <= a["x"]
               or a["y"] + a["height"] <= b["y"] or b["y"] + b["height"] <= a["y"])
      assert apart, (a, b)


def test_text_is_escaped_and_page_is_self_contained(tmp_path):
  seq_path, dist_path = _pair(MISSING)
  seq, dist = load_module(seq_path), load_module(dist_path)
  prepare_seq(seq)
  program = prepare_dist(dist)
  inf = RelationInference(seq, program, program.param_layouts)
  result = inf.run()
  result.failure.diagnosis = "<script>alert('x')</script> & \"more\""
  out = tmp_path / "r.html"
  html_report.write_html(str(out), result, seq.main, inf, "<seq>", dist_path)
  page = out.read_text()
  assert "<script" not in page and html.escape(result.failure.diagnosis) in page
  assert "&lt;seq&gt;" in page
  assert not re.search(r"""(src|href)\s*=|@import|https?://(?!www\.w3\.org/2000/svg")""", page)


def test_unwritable_path_is_one_line_exit_2(tmp_path, capsys):
  bad = tmp_path / "no" / "such" / "dir" / "r.html"
  code = cli.main([*_pair(OK), "--html", str(bad)])
  out, err = capsys.readouterr()
  assert code == 2 and "refines" in out
  assert err.count("\n") == 1 and "cannot write the HTML report" in err and str(bad) in err


# -- in a real browser ------------------------------------------------------------

def _chromium():
  return shutil.which("chromium") or shutil.which("chromium-browser")


def _read_png(path):
  """RGB rows of an 8-bit non-interlaced PNG (what chromium writes), decoded here so
  the test needs no imaging library."""
  data = open(path, "rb").read()
  assert data[:8] == b"\x89PNG\r\n\x1a\n"
  pos, idat = 8, bytearray()
  while pos < len(data):
    n, kind = struct.unpack(">I4s", data[pos:pos + 8])
    if kind == b"IHDR":
      w, h, depth, ctype, _, _, interlace = struct.unpack(">IIBBBBB", data[pos + 8:pos + 21])
    elif kind == b"IDAT":
      idat += data[pos + 8:pos + 8 + n]
    pos += 12 + n
  assert depth == 8 and ctype in (2, 6) and interlace == 0, (depth, ctype, interlace)
  bpp = 3 if ctype == 2 else 4
  raw, stride = zlib.decompress(bytes(idat)), w * bpp
  rows, prev = [], bytearray(stride)
  for y in range(h):
    ft, line = raw[y * (stride + 1)], bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
    for i in range(stride):
      a = line[i - bpp] if i >= bpp else 0
      b, c = prev[i], (prev[i - bpp] if i >= bpp else 0)
      if ft == 1:
        line[i] = (line[i] + a) & 255
      elif ft == 2:
        line[i] = (line[i] + b) & 255
      elif ft == 3:
        line[i] = (line[i] + (a + b) // 2) & 255
      elif ft == 4:
        p = a + b - c
        pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
        line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
    rows.append([tuple(line[x * bpp:x * bpp + 3]) for x in range(w)])
    prev = line
  return rows


def _near(px, rgb, tol=6):
  return all(abs(p - q) <= tol for p, q in zip(px, rgb))


@pytest.mark.skipif(_chromium() is None, reason="chromium not installed "
                    "(apt-get install -y chromium): the browser rendering test needs it")
def test_renders_in_headless_chromium(tmp_path, capsys):
  code, _, page = _cli_report(tmp_path, capsys, MISSING)
  assert code == 1
  png = tmp_path / "shot.png"
  cmd = [_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
         "--no-first-run", "--disable-background-networking", "--disable-component-update",
         "--disable-sync", f"--user-data-dir={tmp_path / 'profile'}", "--hide-scrollbars",
         "--force-device-scale-factor=1", f"--screenshot={png}", "--window-size=1400,1000",
         (tmp_path / f"{MISSING}.html").as_uri()]
  proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
  assert png.exists(), proc.stderr[-2000:]
  rows = _read_png(png)
  assert (len(rows[0]), len(rows)) == (1400, 1000)
  assert len({px for row in rows[::4] for px in row[::4]}) > 50, "the page is blank"

  # The failing node's light-red fill: one box, the size the SVG gives it.  (Rows
  # with only a few such pixels are the legend's swatch.)
  nodes = _nodes(page)
  (fail,) = [r for c, _, r in nodes if "failed" in c]
  red = {y: [x for x, px in enumerate(row) if _near(px, (0xff, 0xcd, 0xd2))]
         for y, row in enumerate(rows)}
  red = {y: xs for y, xs in red.items() if len(xs) > fail["width"] / 2}
  assert red, "no red failing node on screen"
  y0, y1 = min(red), max(red)
  x0, x1 = min(min(xs) for xs in red.values()), max(max(xs) for xs in red.values())
  assert sorted(red) == list(range(y0, y1 + 1)), "one red box"
  assert abs((x1 - x0) - fail["width"]) <= 8 and abs((y1 - y0) - fail["height"]) <= 8
  assert abs(x0 - (BODY_MARGIN_X + fail["x"])) <= 4

  # Every proved node is green where the SVG puts it, relative to the failing one.
  dy = y0 - fail["y"]
  proved = [r for c, _, r in nodes if "proved" in c]
  assert proved
  for r in proved:
    x, y = int(BODY_MARGIN_X + r["x"] + 5), int(dy + r["y"] + r["height"] / 2)
    assert _near(rows[y][x], (0xe8, 0xf5, 0xe9)), (r, rows[y][x])

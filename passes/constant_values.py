"""Values both programs compute from constants alone, related by their numbers.

A sequential value that depends on no input (positions ``iota(n)``, a causal
mask built from them) may have a per-device counterpart the per-device program
computes differently: load-balanced context parallelism under GSPMD reorders
the positions into zig-zag chunks as a table, which XLA's partitioner folds
into a constant and cuts per rank with a ``dynamic_slice`` at the partition's
offset.  No lemma turns ``iota`` into that table; but both sides are numbers
we can compute, the sequential value once and the per-device one on every
rank, and a relation between two known values is checked by comparing them.

``ConstantValues.relations`` proposes the layouts the per-device value may
have (the tilings giving its shape, each also with its dims' chunks in any
order an input's relation uses) and keeps those under which every rank's value
equals its tile of the sequential value exactly.  That is a proof, rank by
rank, for these inputs-free values, the way ``rank_tables`` follows pieces
rank by rank.  Values past ``MAX_ELEMENTS`` (on either side) are not computed:
this is for tables, not for whole activations.
"""

from __future__ import annotations

import itertools
from typing import Iterator, Optional

import numpy as np

from graphguard_hlo import ir
from graphguard_hlo.interpret import Interpreter, Unsupported, mesh_coords
from graphguard_hlo.passes.layout import Layout, shard, tilings_with_local_shape

MAX_ELEMENTS = 1 << 16


def _small_ops(graph: ir.Graph) -> list[ir.Op]:
  """The graph's ops an input-free value may come from: not loops (their
  bodies are related by loops.py), no result past MAX_ELEMENTS."""
  return [op for op in graph.ops if op.name != "while"
          and all(int(np.prod(r.type.shape)) <= MAX_ELEMENTS for r in op.results)]


class ConstantValues:
  def __init__(self, seq: ir.Graph, dist: ir.Graph, mesh: ir.Mesh,
               orders: frozenset[tuple[int, ...]]):
    """``orders``: the chunk orders the inputs' relations use (tried on every
    dim they cut evenly)."""
    self.seq, self.dist, self.mesh, self.orders = seq, dist, mesh, orders
    self._seq_env: Optional[dict] = None
    self._dist_by_type: Optional[dict] = None
    self._dist_env: dict = {}
    self._coords: list = []

  def relations(self, s: ir.Value) -> Iterator[tuple[ir.Value, Layout]]:
    """(per-device value, layout) pairs with ``d@r == tile_r(s)`` on every rank."""
    for d, layout, wrong in self._compared(s):
      if not wrong:
        yield d, layout

  def nearest(self, s: ir.Value) -> Optional[tuple[ir.Value, Layout, list, list]]:
    """For a report: the per-device value and layout holding ``s``'s tiles on
    the most ranks but not all, with the coordinates where it does and does
    not (None if no rank holds one)."""
    best = None
    for d, layout, wrong in self._compared(s):
      if wrong and len(wrong) < len(self._coords) and (best is None or len(wrong) < len(best[2])):
        best = (d, layout, wrong)
    if best is None:
      return None
    d, layout, wrong = best
    return d, layout, [c for c in self._coords if c not in wrong], wrong

  def _compared(self, s: ir.Value) -> Iterator[tuple[ir.Value, Layout, list]]:
    """Every candidate (value, layout) with the coordinates of the ranks whose
    value is not their tile of ``s``."""
    want = self._seq_value(s)
    if want is None:
      return
    for (shape, dtype), values in self._dist_values().items():
      if dtype != s.type.dtype or len(shape) != s.type.rank:
        continue
      for layout in self._layouts(s.type.shape, shape):
        tiles = shard(layout, self.mesh, want)
        for d in values:
          per_rank = self._dist_env[d.id]
          yield d, layout, [c for k, c in enumerate(self._coords)
                            if not np.array_equal(np.asarray(per_rank[k], np.float64), tiles[c])]

  def is_known(self, s: ir.Value) -> bool:
    """Is ``s`` input-free (and small enough to compute)?"""
    return self._seq_value(s) is not None

  def _layouts(self, whole: tuple[int, ...], tile: tuple[int, ...]) -> Iterator[Layout]:
    for plain in tilings_with_local_shape(whole, tile, self.mesh):
      per_dim = [[None] + [c for c in sorted(self.orders) if n % len(c) == 0] for n in whole]
      for choice in itertools.product(*per_dim):
        order = tuple((k, c) for k, c in enumerate(choice) if c is not None)
        yield plain.with_(order=order) if order else plain

  def _seq_value(self, s: ir.Value) -> Optional[np.ndarray]:
    if self._seq_env is None:
      self._seq_env = {}
      Interpreter(1).run_ops(_small_ops(self.seq), self._seq_env)
    found = self._seq_env.get(s.id)
    return None if found is None else np.asarray(found[0], np.float64)

  def _dist_values(self) -> dict:
    """Per-device values known on every rank, by (shape, dtype)."""
    if self._dist_by_type is None:
      self._dist_by_type = {}
      try:
        self._coords = mesh_coords(self.mesh)
      except Unsupported:
        return self._dist_by_type
      Interpreter(len(self._coords)).run_ops(_small_ops(self.dist), self._dist_env)
      for op in self.dist.ops:
        for r in op.results:
          if r.id in self._dist_env:
            self._dist_by_type.setdefault((r.type.shape, r.type.dtype), []).append(r)
    return self._dist_by_type

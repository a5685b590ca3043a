"""StableHLO's constraints on a gather, for dumps no verifier has read.

A StableHLO module is verified by MLIR as it is parsed; XLA's HLO text is
read by our own parser (``hlo_text.py``), which would otherwise take any
dimension numbers it is given.  A gather that breaks them has no meaning in
the spec, and the rules that read gathers (``passes/slabs.py``,
``passes/tile_lookup.py``) assume a well-formed one: an unsorted offset_dims
(a transposed window) or a start on an operand batching dim would be
rewritten into a gather of other elements.  So it is an input error.

The numbers (C1)-(C23) are the spec's, https://openxla.org/stablehlo/spec#gather.
"""

from __future__ import annotations

from typing import Optional, Sequence


def _sorted_unique(xs: Sequence[int]) -> bool:
  return all(a < b for a, b in zip(xs, xs[1:]))


def _in_range(xs: Sequence[int], n: int) -> bool:
  return all(0 <= x < n for x in xs)


def gather_violation(operand: Sequence[int], indices: Sequence[int], result: Sequence[int],
                     offset_dims: Sequence[int], collapsed_slice_dims: Sequence[int],
                     operand_batching_dims: Sequence[int],
                     start_indices_batching_dims: Sequence[int],
                     start_index_map: Sequence[int], index_vector_dim: int,
                     slice_sizes: Sequence[int]) -> Optional[str]:
  """What is wrong with a gather of these shapes and dimension numbers, in
  the spec's words, or None when nothing is."""
  rank, irank = len(operand), len(indices)
  if len(slice_sizes) != rank:  # (C20)
    return f"slice_sizes has {len(slice_sizes)} entries for an operand of rank {rank}"
  if not all(0 <= s <= n for s, n in zip(slice_sizes, operand)):  # (C21)
    return f"slice_sizes {list(slice_sizes)} exceed the operand's shape {list(operand)}"
  if len(offset_dims) + len(collapsed_slice_dims) + len(operand_batching_dims) != rank:  # (C1)
    return ("offset_dims, collapsed_slice_dims and operand_batching_dims must count the "
            f"operand's {rank} dims")
  if not 0 <= index_vector_dim <= irank:  # (C2)
    return f"index_vector_dim {index_vector_dim} is outside the indices' rank {irank}"
  starts = indices[index_vector_dim] if index_vector_dim < irank else 1
  if len(start_index_map) != starts:  # (C3)
    return f"start_index_map has {len(start_index_map)} entries for {starts} start indices"
  if not _sorted_unique(offset_dims):  # (C4)
    return f"offset_dims {list(offset_dims)} must be sorted and distinct"
  if not _in_range(offset_dims, len(result)):  # (C5)
    return f"offset_dims {list(offset_dims)} are outside the result's rank {len(result)}"
  if len(set(collapsed_slice_dims) | set(operand_batching_dims)) != \
      len(collapsed_slice_dims) + len(operand_batching_dims):  # (C6)
    return "collapsed_slice_dims and operand_batching_dims must be distinct"
  for name, dims in (("collapsed_slice_dims", collapsed_slice_dims),
                     ("operand_batching_dims", operand_batching_dims)):
    if not _sorted_unique(dims):  # (C7), (C10)
      return f"{name} {list(dims)} must be sorted"
    if not _in_range(dims, rank):  # (C8), (C11)
      return f"{name} {list(dims)} are outside the operand's rank {rank}"
    if any(slice_sizes[d] > 1 for d in dims):  # (C9), (C12)
      return f"slice_sizes must be 0 or 1 on {name} {list(dims)}"
  if len(set(start_indices_batching_dims)) != len(start_indices_batching_dims) or \
      not _in_range(start_indices_batching_dims, irank):  # (C13), (C14)
    return (f"start_indices_batching_dims {list(start_indices_batching_dims)} must be distinct "
            f"dims of the indices")
  if index_vector_dim in start_indices_batching_dims:  # (C15)
    return "index_vector_dim must not be a start_indices_batching_dim"
  if len(operand_batching_dims) != len(start_indices_batching_dims) or any(
      operand[a] != indices[b] for a, b in zip(operand_batching_dims,
                                               start_indices_batching_dims)):  # (C16), (C17)
    return "operand_batching_dims and start_indices_batching_dims must pair dims of one size"
  if len(set(start_index_map) | set(operand_batching_dims)) != \
      len(start_index_map) + len(operand_batching_dims):  # (C18)
    return ("start_index_map must be distinct and must not start on an operand batching dim "
            f"({list(start_index_map)}, {list(operand_batching_dims)})")
  if not _in_range(start_index_map, rank):  # (C19)
    return f"start_index_map {list(start_index_map)} is outside the operand's rank {rank}"
  expected = _result_shape(operand, indices, offset_dims, collapsed_slice_dims,
                           operand_batching_dims, index_vector_dim, slice_sizes)
  if expected is None:  # (C22)
    return f"offset_dims {list(offset_dims)} do not fit a result of rank " \
        f"{irank - (index_vector_dim < irank) + len(offset_dims)}"
  if tuple(result) != expected:  # (C22)
    return f"the result must have shape {list(expected)}, not {list(result)}"
  return None


def _result_shape(operand, indices, offset_dims, collapsed_slice_dims, operand_batching_dims,
                  index_vector_dim, slice_sizes) -> Optional[tuple[int, ...]]:
  """(C22): the indices' batch dims, with the window's kept sizes at
  offset_dims; None if offset_dims do not fit that rank."""
  batch = [n for d, n in enumerate(indices) if d != index_vector_dim]
  window = [slice_sizes[d] for d in range(len(operand))
            if d not in collapsed_slice_dims and d not in operand_batching_dims]
  if len(window) != len(offset_dims) or any(d >= len(batch) + len(window) for d in offset_dims):
    return None
  shape, batch_it, window_it = [], iter(batch), iter(window)
  for d in range(len(batch) + len(window)):
    shape.append(next(window_it) if d in offset_dims else next(batch_it))
  return tuple(shape)

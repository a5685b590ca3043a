"""The words diagnose.py puts on a wrong scale: the factor, and every mesh
axis whose size it is (a layout's scale does not say which collective made
it, so naming one of several same-size axes would point at the wrong one)."""

from graphguard_hlo import ir
from graphguard_hlo.passes.diagnose import _scale_words


def test_a_factor_of_one_axis_size_names_that_axis():
  words = _scale_words(0.5, ir.Mesh((("dp", 2), ("tp", 4))))
  assert words == ("the distributed value is 2 times the sequential one (summed over 2 = |dp| "
                   "ranks without dividing: psum where pmean belongs?)")


def test_a_factor_several_axes_share_names_them_all():
  words = _scale_words(0.5, ir.Mesh((("dp", 2), ("pp", 2), ("tp", 2))))
  assert "summed over 2 = |dp| or |pp| or |tp| ranks without dividing" in words


def test_a_division_too_many_is_named_as_one():
  words = _scale_words(4.0, ir.Mesh((("dp", 2), ("tp", 4))))
  assert words == ("the distributed value is 0.25 times the sequential one (divided by 4 = |tp| "
                   "once too often: pmean where psum belongs?)")


def test_a_factor_no_axis_has_gets_no_guess():
  words = _scale_words(1 / 3, ir.Mesh((("dp", 2), ("tp", 4))))
  assert words == "the distributed value is 3 times the sequential one"

"""One verification per zoo program for the whole test session.

Three test files read the verifier's outcome on the same programs:
``test_relation_check.py`` (every relation it earned holds on numbers),
``test_verify_models.py`` and ``test_verify_zoo.py`` (the verdict, and where a
seeded bug is reported).  Verifying each program once and handing every file
the same ``(Result, RelationCheck)`` saves the second lowering and
verification, the largest repeated cost of the suite.

It is the same computation as ``pipeline.verify_modules``: ``verify_and_check``
runs ``RelationInference(...).run()`` on the prepared modules, as
``verify_programs`` does, and only then checks relations on numbers, so the
verdict is the one a user gets.  ``test_api.py`` and ``test_cli.py`` call the
public entry points themselves.
"""

from __future__ import annotations

from graphguard_hlo.relation_check import verify_and_check

# Keyed by case name: every test module builds its own Case objects
# (``strategies.model_cases()``, ``cases.all_cases()``), whose names are unique
# (``test_models_numeric.test_names_and_metadata``,
# ``test_zoo_numeric.test_names_unique_and_get_roundtrips``, and
# ``test_relation_check.test_names_do_not_clash`` for the two lists together).
_OUTCOMES: dict[str, tuple] = {}


def verified(case):
  """(Result, RelationCheck) of ``case``, computed at its first request."""
  if case.name not in _OUTCOMES:
    _OUTCOMES[case.name] = verify_and_check(*case.modules(),
                                            nonnegative=case.nonnegative_args,
                                            relation=case.relation)
  return _OUTCOMES[case.name]

"""The pass pipeline: canonicalization of shardings and collectives, then
iterative relation inference (``graphguard_hlo.passes.inference``)."""

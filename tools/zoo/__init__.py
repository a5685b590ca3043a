"""A zoo of (sequential, distributed) JAX program pairs, some with seeded bugs.

``cases`` builds the pairs (hand-written ``shard_map`` collectives and GSPMD
jits of the sequential function); ``numeric`` runs both sides on the same
random inputs, so every bug is known to really change the result before a
static checker is asked to find it.
"""

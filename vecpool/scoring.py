"""The pure functions around scoring, under their former import path.

They live in `vecpool.calls` (pairing inputs) and `vecpool.calls.postprocess` (MaxSim,
cosine, ranking, sparse vectors); this module re-exports them.
"""

from vecpool.calls import as_input_list, pair_indices, pair_up, text_pairs
from vecpool.calls.postprocess import cosine, maxsim, rank, sparse_tokens, sparse_vector

__all__ = [
    "as_input_list",
    "cosine",
    "maxsim",
    "pair_indices",
    "pair_up",
    "rank",
    "sparse_tokens",
    "sparse_vector",
    "text_pairs",
]

"""The pure functions around scoring, under their former import path.

They live in `vecpool.api.calls` (pairing inputs) and `vecpool.api.postprocess` (MaxSim,
cosine, ranking, sparse vectors); this module re-exports them.
"""

from vecpool.api.calls import as_input_list, pair_indices, pair_up, text_pairs
from vecpool.api.postprocess import cosine, maxsim, rank, sparse_tokens, sparse_vector

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

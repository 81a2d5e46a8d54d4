"""The pure post-processing of outputs: they live in `vecpool.calls.postprocess` (model-free)
and are re-exported here."""

from vecpool.calls.postprocess import *  # noqa: F403

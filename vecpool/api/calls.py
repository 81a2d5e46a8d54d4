"""The task calls as plain functions over a `CallContext`: they live in `vecpool.calls`
(model-free, so the server's API processes use them without torch) and are re-exported here."""

from vecpool.calls import *  # noqa: F403
from vecpool.calls import __all__ as __all__

"""`vecpool.ray`: Ray Data over vecpool engine actors (`embed`, `classify`, `score`); the public
name of `vecpool.integrations.ray_data`. Needs the `ray` extra: `pip install 'vecpool[ray]'`."""

from vecpool.integrations.ray_data import DEFAULT_BATCH_SIZE, EngineActor, classify, embed, score

__all__ = ["DEFAULT_BATCH_SIZE", "EngineActor", "classify", "embed", "score"]

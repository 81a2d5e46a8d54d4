"""The endpoints, one file per API family: OpenAI embeddings, pooling, scores (rerank, score,
classify), tokens (tokenize, detokenize), system (models, health, metrics)."""

from vecpool.server.routes import embeddings, pooling, scores, system, tokens

ROUTERS = (
    embeddings.router,
    pooling.router,
    scores.router,
    tokens.router,
    system.router,
)

__all__ = ["ROUTERS"]

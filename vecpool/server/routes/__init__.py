"""The endpoints, one file per API family: OpenAI embeddings, pooling, scores (rerank, score,
classify), tokens (tokenize, detokenize), system (models, health, metrics), and the peers' own
APIs: Cohere (`cohere.py`), Text Embeddings Inference (`tei.py`), SageMaker (`sagemaker.py`)."""

from vecpool.server.routes import (
    cohere,
    embeddings,
    pooling,
    sagemaker,
    scores,
    system,
    tei,
    tokens,
)

ROUTERS = (
    embeddings.router,
    pooling.router,
    scores.router,
    tokens.router,
    system.router,
    cohere.router,
    tei.router,
    sagemaker.router,
)

__all__ = ["ROUTERS"]

"""The HTTP server: OpenAI / Cohere / Jina compatible endpoints over one `AsyncEngine`.

Importing this package imports nothing from the `server` extra; `vecpool.server.app` does
(FastAPI, uvicorn, pydantic, prometheus-client). Start it with `vecpool serve` (or
`python -m vecpool serve`); build an app in Python with `vecpool.server.app.create_app`.
"""

"""Integrations with distributed engines, at the top of the layering like `cli/` and `server/`:
`ray_data` (embed / classify / score a `ray.data.Dataset` over a pool of engine actors, also
importable as `vecpool.ray`) and `ray_serve` (the HTTP API as a Ray Serve deployment). They need
the `ray` extra (`pip install 'vecpool[ray]'`); `import vecpool` never imports Ray."""

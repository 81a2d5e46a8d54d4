"""Models, in rooms, each importing only those below it (an import-linter contract says so):
`loading/` reads a folder (`folder.py`, sentence-transformers modules in `st.py`), chooses the
class (the registry's native one, or the transformers fallback) and loads it strictly
(`loader.py`); `quant/` rewrites a built model's linears; `architectures/` holds one file per
family, the shared encoder and decoder among them; `base.py` is the model contract; `layers/`
the attention paths, kernels, norms and rotary; `hf.py` reads config dicts. Models know nothing
of requests."""

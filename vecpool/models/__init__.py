"""Models: folder reading (`folder.py`, `hf.py`), the strict loader, sentence-transformers
modules with weights (`st.py`), shared layers and attention, and one file per architecture,
registered by `architectures[0]` (`registry.py`). Models know nothing of requests."""

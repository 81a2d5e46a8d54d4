"""Pooling: which rows an output reads (`methods.py`), what a task computes from them
(`heads.py`), and which heads a loaded model serves (`build.py`)."""

"""The runners: what one step runs (`step.py`), its flat batch (`batch.py`), the model on its
device (`model_runner.py`, `compiled.py`) and the pooling of its hidden states
(`pooling_runner.py`). Only code common to every model belongs here."""

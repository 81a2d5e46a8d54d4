"""The engine: request state (`request.py`), the scheduler that decides what each step runs
(`scheduler.py`), and the loop that schedules, runs and pools (`core.py`). It hands the runners
plain step data (`vecpool.runner.step`), never its `Request` objects."""

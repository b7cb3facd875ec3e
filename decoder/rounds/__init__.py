"""Where a round runs and commits: one generation (session.py), many in one pass (batch.py),
continuous batching (scheduler.py), `--depth auto` for a lone session (controller.py) and the
acceptance rule on the device (acceptance.py)."""

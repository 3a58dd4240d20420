"""The `shardcheck` command: `main.py` parses and dispatches, `progress.py` is what `run` shows."""

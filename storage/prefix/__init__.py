"""Reuse of computed prompts: the prefix index (hash-chained token blocks), the prefix store that
reuses them across ``generate`` calls, and held contexts handed out as forks."""

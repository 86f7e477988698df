"""The passkey needle's wording, shared by the ``needle`` task and the default model's training.

A needle line is hidden in filler text (Python source in the default setup, so it is written as a
comment); the prompt ends with :data:`QUESTION` and the model must continue with the key.
"""

from __future__ import annotations

QUESTION = "# What is the pass key? The pass key is "
"""The prompt's last line; the expected continuation is the key itself."""


def needle_line(key: str) -> str:
    """The line that hides ``key`` (one line, ending in a newline)."""
    return f"# The pass key is {key}. Remember it. {key} is the pass key.\n"

"""What every benchmark report records about where it ran: the library revision, the command
line without machine paths, and the ~100M random-weight Llama the speed benchmarks share."""

from __future__ import annotations

import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LIBRARY_DIRS = ("kvlib", "adapters", "policies", "storage")
"""What the revision in a report describes (benchmark and test edits do not count)."""

LLAMA100M = {"hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12, "num_key_value_heads": 4,
             "intermediate_size": 2048, "vocab_size": 32000}
"""``LlamaConfig`` sizes of the ~100M-parameter random Llama (tied embeddings, fp32)."""


def git_revision() -> str:
    """HEAD, flagged when the library's code differs from it."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True)
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", *LIBRARY_DIRS], cwd=REPO, capture_output=True, text=True
        )
        return head.stdout.strip() + (" (with uncommitted library changes)" if dirty.stdout.strip() else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def no_machine_path(arg: str) -> str:
    """An absolute path (e.g. a tmp ``--out``) becomes ``<path>``, so reports name no machine path."""
    flag, eq, value = arg.partition("=")
    if eq and Path(value).is_absolute():
        return f"{flag}=<path>"
    return "<path>" if Path(arg).is_absolute() else arg

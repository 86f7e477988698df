"""The ``kvlib`` command line. ``kvlib list`` shows every registered strategy (plugins included)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from kvlib.errors import SpecError
from kvlib.registry import available_policies, get_policy
from kvlib.spec import parameters_help


SUMMARY_CHARS = 160
"""Longest one-line summary ``kvlib list`` prints (cut at a word, with "...")."""


def summary(doc: str | None) -> str:
    """A docstring's first paragraph on one line, at most :data:`SUMMARY_CHARS` characters."""
    paragraph = (doc or "").strip().split("\n\n")[0]
    text = " ".join(paragraph.split())
    if len(text) <= SUMMARY_CHARS:
        return text
    return text[: text.rfind(" ", 0, SUMMARY_CHARS - 3)] + "..."


def list_policies() -> str:
    """Every registered strategy by kind, with its parameters, defaults and one-line doc."""
    lines = []
    for kind, names in available_policies().items():
        lines.append(f"{kind}:")
        if not names:
            lines.append("  (none yet)")
        for name in names:
            cls = get_policy(name)
            lines.append(f"  {name}: {summary(cls.__doc__)}")
            lines.append(f"      parameters: {parameters_help(cls)}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvlib",
        description="kvlib: pluggable KV-cache management for transformer inference.",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    commands.add_parser("list", help="list registered strategies by kind, with parameters and defaults")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "list":
            print(list_policies())
            return 0
    except (SpecError, ValueError) as exc:
        print(f"kvlib: error: {exc}", file=sys.stderr)
        return 2
    parser.print_help()
    return 0


if __name__ == "__main__":
    sys.exit(main())

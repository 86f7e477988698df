"""Errors raised by kvlib. Bad input is a ``ValueError`` (or a subclass) raised before any work."""

from __future__ import annotations

ECHO_CHARS = 80
"""Most characters of a user-given name or value an error message repeats (see :func:`quoted`)."""


class SpecError(ValueError):
    """A spec string or policy object is invalid; the message lists what is valid."""


class ModelLoadError(ValueError):
    """A model or its tokenizer could not be loaded (or fetched, or converted); the message is one line."""


class PoolExhaustedError(RuntimeError):
    """A fixed-capacity page pool has fewer free pages than an operation needs.

    Raised before the operation changes anything, so nothing already stored is lost.
    """


def cut(text: str, limit: int = ECHO_CHARS) -> str:
    """``text`` for an error message, cut to at most ``limit`` characters (ending in ``...``) so
    that a huge name or value does not flood the message."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


def quoted(value: object, limit: int = ECHO_CHARS) -> str:
    """``repr(value)`` for an error message, :func:`cut` to ``limit`` characters."""
    return cut(repr(value), limit)


class DiskTierUnavailable(RuntimeError):
    """A directory cannot hold a disk tier: it cannot be created or written, or its damaged
    files cannot be moved aside. The message names the directory and what failed."""


class RemoteAccessDenied(RuntimeError):
    """A remote tier's server refused kvlib's credentials (a wrong or missing password) or a command
    it needs (an ACL). Not an outage: raised, never counted as a miss. The message names the
    server with its password redacted."""

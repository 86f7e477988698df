"""An Engine's part in prefill/decode hand-overs: sending requests (``role="prefill"``) or receiving
them (``role="decode"``), through the server of its remote tier, by the protocol of
:mod:`~kvlib.adapters.engine.handover` (the message, the tail records of last partial pages).

Sending: a prefill engine makes each request's message when it prepares the request
(:meth:`HandOverRole.message`) and keeps it while the prompt (all but its last token) is
prefilled (:meth:`HandOverRole.queued`); when the prefill finishes
(:meth:`HandOverRole.finish`) the token it produced is dropped (the decode side draws every
output token), the last partial page is published as a tail record and the message is pushed. A
one-token prompt has nothing to prefill: its message is pushed as soon as it is queued.

Receiving: a decode engine pops at most :data:`MAX_MESSAGES_PER_RECEIVE` messages per
:meth:`HandOverRole.receive`, opens and checks each (:meth:`HandOver.from_bytes
<kvlib.adapters.engine.handover.HandOver.from_bytes>` against this engine's
:class:`~kvlib.adapters.engine.handover.MessageLimits`) and queues it as its own request.

Invariants: each message is pushed once and counted once, in ``handed_over`` when the server took
it, else in ``lost_handovers``; a ``(sender, id)`` is queued at most once (a replay or a duplicate
is refused); ``receive`` never raises for what it pops: a message refused is counted in
``bad_handovers`` and skipped, and every genuine one popped in the call is queued and returned.
The three counters exist, at zero, whatever the role.
"""

from __future__ import annotations

import math
import secrets
import time
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvlib.adapters.engine.handover import HandOver, MessageLimits
from kvlib.errors import quoted

if TYPE_CHECKING:
    from kvlib.adapters.engine.engine_request import Request
    from kvlib.adapters.engine.kv_manager import KVManager
    from kvlib.storage.remote_tier import RemoteTier

ROLES = ("both", "prefill", "decode")
MAX_MESSAGES_PER_RECEIVE = 1024
"""Messages :meth:`HandOverRole.receive` (:meth:`Engine.receive <kvlib.adapters.engine.engine.Engine.receive>`)
pops at most per call, so a queue fed faster than it is read never keeps a decode worker from stepping."""

Take = Callable[[list[int], dict], int]
"""Queues a received request on the engine (its prompt's token ids and ``add_request``'s keywords)
and returns its local id; ``ValueError`` for a request the engine refuses."""


def check_role(role: str, handover_queue: str, remote: object) -> None:
    """``ValueError`` for a role not in :data:`ROLES`, a split role without a ``remote`` server, or
    a ``handover_queue`` that is not a non-empty str."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {quoted(role)}")
    if role != "both" and remote is None:
        raise ValueError(f"role={quoted(role)} hands requests over through a server: give remote=")
    if not isinstance(handover_queue, str) or not handover_queue:
        raise ValueError(f"handover_queue must be a non-empty str, got {handover_queue!r}")


class HandOverRole:
    """One engine's hand-over state and work (see the module docstring).

    Args:
        role: ``"both"`` (no hand-overs), ``"prefill"`` or ``"decode"`` (see :func:`check_role`).
        queue: the name of the server list prefill engines push to and decode engines pop.
        kv: the engine's KV manager; a split role's has a prefix store with a remote tier, whose
            server carries the messages and pages and whose fingerprint names the model.
        vocab: token ids a received message may hold are in ``[0, vocab)``.
        max_tokens: most tokens (prompt plus new) of a received request (the model's context).
    """

    def __init__(self, role: str, queue: str, kv: KVManager, *, vocab: int, max_tokens: int) -> None:
        self.role, self.queue, self.kv = role, queue, kv
        self.vocab, self.max_tokens = vocab, max_tokens
        self.sender = secrets.token_hex(16)
        """Prefill role: the token naming this engine in its messages (request ids repeat across engines)."""
        self.pending: dict[int, HandOver] = {}
        """Prefill role: the message of each request being prefilled, by request id."""
        self.taken: set[tuple[str, int]] = set()
        """Decode role: the ``(sender, id)`` of every message taken, so a replay or a duplicate is refused."""
        self.handover_s: dict[int, float] = {}
        """Decode role: seconds from a hand-over's start (prefill side) to its request queued here with its pages, by request id."""
        self.counters = {"handed_over": 0, "lost_handovers": 0, "bad_handovers": 0}
        if role != "both":
            _warn_if_queues_evict(kv.prefix.remote)

    # -- sending (prefill role) ----------------------------------------------------------------

    def message(self, ids: list[int], settings: dict) -> HandOver:
        """The message for a request of prompt ``ids`` added with ``settings`` (checked); its id
        is given when it is queued (:meth:`queued`)."""
        return HandOver.of(-1, ids, settings, model=self.kv.prefix.fingerprint.hex(), sender=self.sender)

    def queued(self, request: Request, handover: HandOver) -> bool:
        """``request`` (whose message is ``handover``) was given its id: a one-token prompt is
        handed over at once (True: nothing to prefill, nothing to schedule), any other kept
        until its prefill finishes (False)."""
        handover.id = request.request_id
        if len(handover.tokens) == 1:
            self.push(handover)
            return True
        self.pending[request.request_id] = handover
        return False

    def finish(self, request: Request, produced: dict[int, list[int]]) -> None:
        """``request`` is done: if it was being prefilled for a hand-over, its token in
        ``produced`` and its output are dropped (the decode side draws every output token), its
        last partial page is published and its message pushed; otherwise nothing."""
        handover = self.pending.pop(request.request_id, None)
        if handover is None:
            return
        produced.pop(request.request_id, None)
        request.output.clear()
        handover.sent_at = time.time()
        self.kv.publish_tail(request)
        self.push(handover)

    def push(self, handover: HandOver) -> None:
        """Send ``handover`` to the decode side; a push the server did not take (down, full, out
        of memory) is counted in ``lost_handovers``, never in ``handed_over``."""
        if self.kv.prefix.remote.push(self.queue, handover.to_bytes()):
            self.counters["handed_over"] += 1
        else:
            self.counters["lost_handovers"] += 1

    # -- receiving (decode role) ---------------------------------------------------------------

    def receive(self, wait_s: float, take: Take) -> dict[int, int]:
        """Queue (with ``take``) every request handed over so far, waiting up to ``wait_s``
        seconds for the first; returns the local request id of each, by the prefill side's id (see
        :meth:`Engine.receive <kvlib.adapters.engine.engine.Engine.receive>`)."""
        if isinstance(wait_s, bool) or not isinstance(wait_s, (int, float)) or not 0 <= wait_s < math.inf:
            raise ValueError(f"wait_s must be a finite number of seconds >= 0, got {quoted(wait_s)}")
        remote, received = self.kv.prefix.remote, {}
        value = remote.pop(self.queue, wait_s)
        for popped in range(1, MAX_MESSAGES_PER_RECEIVE + 1):
            if value is None:
                break
            taken = self._take_over(value, take)
            if taken is not None:
                received[taken[0]] = taken[1]
            value = remote.pop(self.queue, 0.0) if popped < MAX_MESSAGES_PER_RECEIVE else None
        return received

    def _take_over(self, value: bytes, take: Take) -> tuple[int, int] | None:
        """Queue the request in ``value`` (popped from the hand-over queue); returns ``(prefill
        side's id, local id)``, or None for a message refused (counted in ``bad_handovers``)."""
        limits = self._message_limits()
        try:
            message = self.kv.prefix.remote.open_message(self.queue, value, limits.max_bytes)
            if message is None:
                raise ValueError("longer than any hand-over message, or not sealed with this engine's remote key")
            handover = HandOver.from_bytes(message, limits)
            origin = (handover.sender, handover.id)
            if origin in self.taken:
                raise ValueError(f"hand-over {origin} was taken already (a replay or a duplicate id)")
            local = take(handover.tokens, handover.settings() | {"spec": None, "budget": None})
        except ValueError:
            self.counters["bad_handovers"] += 1
            return None
        self.taken.add(origin)
        self.handover_s[local] = time.time() - handover.sent_at
        return handover.id, local

    def _message_limits(self) -> MessageLimits:
        """What this engine accepts in a hand-over message: its model, vocabulary and context."""
        return MessageLimits(self.kv.prefix.fingerprint.hex(), self.vocab, self.max_tokens)


def _warn_if_queues_evict(remote: RemoteTier) -> None:
    """Warn when ``remote``'s server may evict hand-over queues (``maxmemory-policy allkeys-*``);
    the warning points at the code that built the Engine."""
    policy = remote.eviction_policy()
    if policy is not None and policy.startswith("allkeys"):
        warnings.warn(
            f"the remote server's maxmemory-policy is {policy}: when it fills, queued hand-over messages are evicted like"
            " records (lost requests); run it with volatile-lru (records have a time to live, queues none) or noeviction",
            RuntimeWarning,
            stacklevel=4,
        )

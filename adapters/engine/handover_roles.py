"""An Engine's part in prefill/decode hand-overs: sending requests (``role="prefill"``) or receiving
them (``role="decode"``), through the server of its remote tier, by the protocol of
:mod:`~kvlib.adapters.engine.handover` (the message, the tail records of last partial pages).

Sending: a prefill engine makes each request's message when it prepares the request
(:meth:`HandOverRole.message`) and keeps it while the prompt (all but its last token) is
prefilled (:meth:`HandOverRole.queued`); when the prefill finishes
(:meth:`HandOverRole.finish`) the token it produced is dropped (the decode side draws every
output token), the last partial page is published as a tail record and the message is pushed. A
one-token prompt has nothing to prefill: its message is pushed as soon as it is queued.

Receiving: a decode engine looks at most :data:`MAX_MESSAGES_PER_RECEIVE` messages per
:meth:`HandOverRole.receive` without taking them (:meth:`RemoteTier.peek
<kvlib.storage.tiers.remote_tier.RemoteTier.peek>`), opens and checks each (its tag; :meth:`HandOver.from_bytes
<kvlib.adapters.engine.handover.HandOver.from_bytes>` against this engine's
:class:`~kvlib.adapters.engine.handover.MessageLimits`; its age; this engine's own request checks)
and only then takes it (:meth:`RemoteTier.take <kvlib.storage.tiers.remote_tier.RemoteTier.take>`: its
``sender:id`` recorded in the queue's taken set on the server, the message removed, in one
transaction) and queues it as its own request.

Replays: the taken set lives on the server under the key's names, so a message taken once is
refused by every decode engine on that queue, and after restarts, for as long as it could pass
its age check (``max_age_s``, :data:`FUTURE_SKEW_S` ahead for clocks that differ); a message older
than that is refused by its age alone (the set forgets ids that old). A server restarted without
persistence forgets the set: a message captured before could then be replayed within ``max_age_s``.

Results: :meth:`HandOverRole.receive` keys each request by :class:`HandOverKey` (the prefill
engine's random ``sender`` token and its request id), so two prefill engines' equal ids never
collide and a replay never replaces a genuine request.

Invariants: each message is pushed once and counted once, in ``handed_over`` when the server took
it, else in ``lost_handovers``; a ``(sender, id)`` is queued at most once on a server; ``receive``
never raises for what it reads: a message refused is counted in ``bad_handovers`` and removed, a
message another decode engine took first is left to it, and every genuine one taken in the call
is queued and returned. The three counters exist, at zero, whatever the role. What the role keeps
per request (a prefill's pending message, a decode's hand-over time) is dropped by :meth:`forget`
when the Engine lets the request go, so a long-running engine's role holds a bounded amount.
"""

from __future__ import annotations

import math
import secrets
import time
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

from kvlib.adapters.engine.handover import HandOver, MessageLimits
from kvlib.errors import quoted

if TYPE_CHECKING:
    from kvlib.adapters.engine.engine_request import Request
    from kvlib.adapters.engine.kv_manager import KVManager
    from kvlib.storage.tiers.remote_tier import RemoteTier

ROLES = ("both", "prefill", "decode")
MAX_MESSAGES_PER_RECEIVE = 1024
"""Messages :meth:`HandOverRole.receive` (:meth:`Engine.receive <kvlib.adapters.engine.engine.Engine.receive>`)
reads at most per call, so a queue fed faster than it is read never keeps a decode worker from stepping."""
MAX_AGE_S = 300.0
"""Seconds a hand-over message may take from its prefill engine to a decode engine, by default."""
FUTURE_SKEW_S = 60.0
"""Seconds a message's send time may lie ahead of this host's clock (hosts' clocks differ)."""

Prepare = Callable[[list[int], dict], object]
"""Checks a received request as the engine would queue it (its prompt's token ids and
``add_request``'s keywords) and returns it prepared, queueing nothing; ``ValueError`` for a
request the engine refuses."""
Enqueue = Callable[[object], int]
"""Queues a prepared request on the engine and returns its local id."""


class HandOverKey(NamedTuple):
    """A handed-over request, as :meth:`Engine.receive <kvlib.adapters.engine.engine.Engine.receive>`
    keys it: the prefill engine's ``sender`` token (:attr:`Engine.handover_sender
    <kvlib.adapters.engine.engine.Engine.handover_sender>`) and its request id there."""

    sender: str
    id: int


def check_role(role: str, handover_queue: str, remote: object, max_age_s: float = MAX_AGE_S) -> None:
    """``ValueError`` for a role not in :data:`ROLES`, a split role without a ``remote`` server, a
    ``handover_queue`` that is not a non-empty str, or a ``max_age_s`` that is not a finite number
    of seconds > 0."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {quoted(role)}")
    if role != "both" and remote is None:
        raise ValueError(f"role={quoted(role)} hands requests over through a server: give remote=")
    if not isinstance(handover_queue, str) or not handover_queue:
        raise ValueError(f"handover_queue must be a non-empty str, got {handover_queue!r}")
    if isinstance(max_age_s, bool) or not isinstance(max_age_s, (int, float)) or not 0 < max_age_s < math.inf:
        raise ValueError(f"handover_max_age_s must be a finite number of seconds > 0, got {quoted(max_age_s)}")


class HandOverRole:
    """One engine's hand-over state and work (see the module docstring).

    Args:
        role: ``"both"`` (no hand-overs), ``"prefill"`` or ``"decode"`` (see :func:`check_role`).
        queue: the name of the server list prefill engines push to and decode engines pop.
        kv: the engine's KV manager; a split role's has a prefix store with a remote tier, whose
            server carries the messages and pages and whose fingerprint names the model.
        vocab: token ids a received message may hold are in ``[0, vocab)``.
        max_tokens: most tokens (prompt plus new) of a received request (the model's context).
        max_age_s: seconds a received message may have taken since it was sent (older: refused).
    """

    def __init__(self, role: str, queue: str, kv: KVManager, *, vocab: int, max_tokens: int, max_age_s: float = MAX_AGE_S) -> None:
        self.role, self.queue, self.kv = role, queue, kv
        self.vocab, self.max_tokens, self.max_age_s = vocab, max_tokens, float(max_age_s)
        self.sender = secrets.token_hex(16)
        """Prefill role: the token naming this engine in its messages (request ids repeat across engines)."""
        self.pending: dict[int, HandOver] = {}
        """Prefill role: the message of each request being prefilled, by request id."""
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
        self.kv.publish_tail(request)
        self.push(handover)

    def forget(self, request_id: int) -> None:
        """The engine let request ``request_id`` go (finished and released, or aborted): what this
        role kept for it is dropped (an aborted prefill's message is never sent)."""
        self.pending.pop(request_id, None)
        self.handover_s.pop(request_id, None)

    def push(self, handover: HandOver) -> None:
        """Stamp ``handover``'s send time and send it to the decode side; a push the server did not
        take (down, full, out of memory) is counted in ``lost_handovers``, never in ``handed_over``."""
        handover.sent_at = time.time()
        if self.kv.prefix.remote.push(self.queue, handover.to_bytes()):
            self.counters["handed_over"] += 1
        else:
            self.counters["lost_handovers"] += 1

    # -- receiving (decode role) ---------------------------------------------------------------

    def receive(self, wait_s: float, prepare: Prepare, enqueue: Enqueue) -> dict[HandOverKey, int]:
        """Queue every request handed over so far (checked with ``prepare``, queued with
        ``enqueue``), waiting up to ``wait_s`` seconds for the first; returns the local request id
        of each, by :class:`HandOverKey` (see :meth:`Engine.receive
        <kvlib.adapters.engine.engine.Engine.receive>`)."""
        if isinstance(wait_s, bool) or not isinstance(wait_s, (int, float)) or not 0 <= wait_s < math.inf:
            raise ValueError(f"wait_s must be a finite number of seconds >= 0, got {quoted(wait_s)}")
        remote, received, read = self.kv.prefix.remote, {}, 0
        values = remote.peek(self.queue, wait_s)
        while values:
            for value in values:
                taken = self._take_over(value, prepare, enqueue)
                if taken is not None:
                    received[taken[0]] = taken[1]
                read += 1
                if read >= MAX_MESSAGES_PER_RECEIVE:
                    return received
            values = remote.peek(self.queue, 0.0)
        return received

    def _take_over(self, value: bytes, prepare: Prepare, enqueue: Enqueue) -> tuple[HandOverKey, int] | None:
        """Check the message in ``value`` (read from the hand-over queue), take it off the queue
        and queue its request; returns its key and local id, or None for a message refused
        (counted in ``bad_handovers`` and removed), taken by another decode engine first, or left
        queued because the server did not answer."""
        limits, remote = self._message_limits(), self.kv.prefix.remote
        try:
            message = remote.open_message(self.queue, value, limits.max_bytes)
            if message is None:
                raise ValueError("longer than any hand-over message, or not sealed with this engine's remote key")
            handover = HandOver.from_bytes(message, limits)
            now = time.time()
            if not now - self.max_age_s <= handover.sent_at <= now + FUTURE_SKEW_S:
                raise ValueError(
                    f"a hand-over sent {now - handover.sent_at:.0f} s ago; this engine takes those of the last {self.max_age_s:.0f} s"
                )
            prepared = prepare(handover.tokens, handover.settings() | {"spec": None, "budget": None})
        except ValueError:
            self.counters["bad_handovers"] += 1
            remote.discard(self.queue, value)
            return None
        taken = remote.take(self.queue, value, f"{handover.sender}:{handover.id}", handover.sent_at, now - self.max_age_s - FUTURE_SKEW_S)
        if taken is None:  # no answer: it stays queued for a later call
            return None
        new, removed = taken
        if not new:
            self.counters["bad_handovers"] += removed  # a replay or a duplicate; not removed: another engine took it first
            return None
        local = enqueue(prepared)
        self.handover_s[local] = time.time() - handover.sent_at
        return HandOverKey(handover.sender, handover.id), local

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

"""Policy base classes, one per kind, and what the engine hands to policies.

A policy is a dataclass with typed, documented fields, registered under a short name with
:func:`kvlib.register`. Its fields are validated on construction (by type annotation, see
:mod:`kvlib.params`); a subclass with range checks of its own defines ``__post_init__`` and calls
``super().__post_init__()`` first.

Kinds and how many of each one spec may hold:

=============  ====  ==========================================================
kind           max   decides
=============  ====  ==========================================================
eviction       1     which stored tokens to drop (wrappers take another inside)
budget         1     how a token budget splits over layers and heads
quantization   1     the codec of sealed pages
lowrank        1     a codec or transform in a lower-rank space
reuse          any   what is shared between sequences and requests
tiering        1     where pages live and when they move
recompute      1     what a layer stores instead of keys and values, recomputed on read
=============  ====  ==========================================================
"""

from __future__ import annotations

import abc
import dataclasses
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from kvlib.codec import Codec
from kvlib.layer_view import NEEDS, LayerView
from kvlib.layer_view import Rope as Rope  # re-exported: kvlib.policy.Rope is where policies import it from
from kvlib.params import coerce, field_default
from kvlib.placement import PageStats, lowest_score_first
from kvlib.registry import declare_kinds
from kvlib.spec_text import parse_policy

ContextPrefill = Callable[[torch.nn.Module, Any, torch.Tensor, Any, dict], None]
"""``prefill(model, cache, context_ids, tokenizer, memo)``: fill the empty ``cache`` with
``context_ids`` (int64 ``[batch, tokens]``, no padding); ``tokenizer`` has kvlib's eval interface
(:class:`~kvlib.eval.models.TextTokenizer`); ``memo`` is a dict the caller keeps for this context
and model across the caches it reads the context into (other budgets, other policies): what the
procedure computes from the context alone may be kept there under a key that names everything it
depends on, and reused (an empty dict when the context is read once). See
:meth:`Eviction.context_prefill`."""


class Policy:
    """Base of every policy. Subclasses are dataclasses; ``name`` is set by ``register``."""

    kind: ClassVar[str] = ""
    name: ClassVar[str] = ""

    def __post_init__(self) -> None:
        hints = typing.get_type_hints(type(self))
        for field in dataclasses.fields(self):
            if not field.init:  # internal state, not a parameter
                continue
            value = coerce(self.name or type(self).__name__, field.name, hints[field.name], getattr(self, field.name))
            object.__setattr__(self, field.name, value)

    def spec(self) -> str:
        """This policy as a spec string, naming only parameters that differ from the defaults."""
        changed = []
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if not field.init:
                continue
            default = field_default(field)
            if default is dataclasses.MISSING or value != default:
                shown = value.spec() if isinstance(value, Policy) else value
                changed.append(f"{field.name}={shown!r}")
        return f"{self.name}({', '.join(changed)})" if changed else self.name

    @classmethod
    def coerce_parameter(cls, value: object) -> Policy:
        """``value`` as a parameter of this policy type: a policy object of it, or a
        one-policy spec string naming one (``"snapkv(window=16)"``); ``TypeError`` otherwise."""
        if isinstance(value, str):
            value = parse_policy(value)
        if isinstance(value, cls):
            return value
        raise TypeError(f"expected a {cls.kind} policy")

    @classmethod
    def check_registration(cls, name: str) -> None:
        """``ValueError`` if this class cannot be registered as ``name`` for reasons of its kind
        (the registry checks the kind base and the dataclass itself)."""


class WithInner:
    """A wrapper policy's declaration (``needs``, ``reads_kv``) that follows its ``inner``
    policy: on an instance, ``combine(own, the inner's)``; on the class, where the registry
    checks it, ``own``. Written as a class attribute, e.g. ``needs =
    WithInner(frozenset({"budget"}), frozenset.union)`` or ``reads_kv = WithInner(True, lambda
    own, inner: inner)`` (the inner's alone), so the cache computes nothing the inner does not use."""

    def __init__(self, own: object, combine: Callable[[object, object], object]) -> None:
        self.own, self.combine = own, combine

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, instance: Policy | None, owner: type | None = None) -> object:
        return self.own if instance is None else self.combine(self.own, getattr(instance.inner, self.name))


class Eviction(Policy, abc.ABC):
    """Decides which stored tokens to drop: scores each stored token, higher means keep.

    The engine keeps each head's top-scored valid tokens within its budget; scores of invalid
    slots are ignored.
    """

    kind = "eviction"
    needs: ClassVar[frozenset[str]] = frozenset()
    reads_kv: ClassVar[bool] = True
    """Whether :meth:`score` reads the view's ``keys`` or ``values``. True (the default, safe for
    any plugin): each compaction after a call that attended straight over the pages (a decode
    step) reads the layer's stored tokens into a transient dense copy for it. False (policies
    that score by positions and what ``needs`` asks for): the view's keys and values then have no
    channels (``[batch, kv_heads, slots, 0]``), attention weights are read from the pages, and no
    dense copy of the layer is made."""
    order_free: ClassVar[bool] = False
    """True when :meth:`score` gives each token the same score whatever order its slots come in
    (it ranks by ``positions``, never by slot index or slot neighbours): it then scores the slots
    where they lie. Otherwise, once a compaction has put slots out of position order, it scores a
    view permuted into position order (a copy of the layer's keys and values per call)."""
    shares_prefill: ClassVar[bool] = True
    """Whether a comparison may run the prompt once for this policy and many others and replay
    the prompt call's after-attention inputs into its cache (:mod:`kvlib.adapters.cache.shared_prefill`).
    True where the policy's state after a prompt call depends only on what :meth:`score` and
    :meth:`attention_received` are given (its ``needs``); a policy that keeps state of its own
    across calls, or reads anything else of the model call, sets False and runs apart."""

    @abc.abstractmethod
    def score(self, view: LayerView) -> torch.Tensor:
        """Keep-scores ``[batch, kv_heads, slots]`` (float) for the tokens of ``view``."""

    @classmethod
    def check_registration(cls, name: str) -> None:
        unknown = set(cls.needs) - NEEDS
        if unknown:
            raise ValueError(f"policy {name!r} needs unknown inputs {sorted(unknown)}; valid: {sorted(NEEDS)}")
        if "recent_queries" in cls.needs and not cls.reads_kv:
            raise ValueError(f"policy {name!r} needs recent_queries, whose attention is computed from the keys: reads_kv must be True")

    def ring_start(self) -> int | None:
        """For a policy whose choice, once a head holds its cap, is always the head's oldest token
        past its earliest ``n`` (by position): ``n``. A held cap then runs as a ring of slots
        (:mod:`~kvlib.storage.store.step_plan`): each new token takes that token's slot before the step, and
        nothing is scored. None (the default): the policy scores."""
        return None

    def observed_queries(self) -> int | None:
        """How many of a call's last queries ``window_queries`` and ``attention`` cover (None: all)."""
        return None

    def default_budget(self) -> Budget | None:
        """The budget allocation this policy comes with when the spec names none (None: uniform)."""
        return None

    def context_prefill(self) -> ContextPrefill | None:
        """How a cache with this policy reads a context that questions will follow (kvpress's
        protocol: the context is compressed, then each question is read and answered), where the
        policy has a procedure of its own for it (KVzip's reconstruction passes). None (the
        default): the context is one more prompt, read by one forward call through the cache."""
        return None

    def prompt_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """int64 ``[batch]``: the cap per (layer, head) on average that a call of more than one token
        (a prompt or prompt chunk) compacts to, under an int budget of ``tokens`` per head (the
        default: ``tokens``). A policy that reserves part of the budget for decoding returns less."""
        return tokens

    def attention_received(
        self,
        weights: torch.Tensor,
        query_positions: torch.Tensor,
        key_positions: torch.Tensor,
        prompt_lengths: torch.Tensor | None,
        layer_idx: int,
    ) -> torch.Tensor:
        """What each query adds to ``accumulated_attention``: float32 ``[batch, query_heads,
        queries, slots]`` from ``weights`` (the queries' softmax attention over the stored slots,
        0 where they cannot see), ``query_positions`` int64 ``[batch, queries]`` (-1: padding),
        ``key_positions`` int64 ``[batch, kv_heads, slots]`` (-1: invalid) and ``prompt_lengths``
        (``[batch]``, given when the policy needs ``prompt_length``). By default the weights
        themselves (H2O's accumulated attention); it must stay 0 where ``weights`` is 0."""
        return weights


class EvictionWrapper(Eviction, abc.ABC):
    """An eviction policy built around an ``inner`` one (a dataclass field of the subclass, with
    its ``needs`` and ``reads_kv`` declared by :class:`WithInner`): what it does not decide itself
    it answers as its inner does (the budget allocation it comes with, a prompt's share of an
    int budget, what each query adds to accumulated attention, how many queries are observed).
    A subclass overrides what it decides (SCOPE keeps a decode share of the budget, KVCrush
    observes its own window where its inner reads no attention)."""

    inner: Eviction

    def observed_queries(self) -> int | None:
        return self.inner.observed_queries()

    def default_budget(self) -> Budget | None:
        return self.inner.default_budget()

    def prompt_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.inner.prompt_tokens(tokens)

    def attention_received(self, *arguments, **keywords) -> torch.Tensor:
        """The inner policy's (the arguments of :meth:`Eviction.attention_received`, forwarded)."""
        return self.inner.attention_received(*arguments, **keywords)


@dataclass
class BudgetRequest:
    """What a budget allocation sees of one layer call that is to be compacted.

    ``tokens`` int64 ``[batch]``: the spec's budget for this call, in tokens per (layer, head)
    on average (so ``tokens * kv_heads * num_layers`` for a whole row); ``counts`` int64
    ``[batch, kv_heads]``: the tokens each head may keep from (its candidates). ``scores`` and
    ``candidates`` (``[batch, kv_heads, slots]``) are given to allocations with ``needs_scores``.
    ``seen`` int64 ``[batch]``: the real tokens the row has seen, this call's included (None in a
    request built without a call, e.g. by hand in a test).
    """

    layer_idx: int
    num_layers: int
    tokens: torch.Tensor
    counts: torch.Tensor
    scores: torch.Tensor | None = None
    candidates: torch.Tensor | None = None
    seen: torch.Tensor | None = None


class Budget(Policy, abc.ABC):
    """Splits a token budget over layers and heads: how many tokens each head of a layer keeps.

    ``caps`` returns int64 ``[batch, kv_heads]``; the engine clamps each to the head's candidate
    count. Allocations that need the eviction scores (one top-k across heads) set ``needs_scores``.
    """

    kind = "budget"
    needs_scores: ClassVar[bool] = False

    def check_model(self, layer_kv_heads: Sequence[int]) -> None:
        """``ValueError`` if this allocation cannot serve a model whose KV layers have these KV
        heads (one entry per KV layer; checked before any model work)."""

    def layer_tokens(self, request: BudgetRequest) -> torch.Tensor:
        """int64 ``[batch]``: tokens this layer keeps in all its heads together (default: ``tokens * heads``)."""
        return request.tokens * request.counts.shape[1]

    @abc.abstractmethod
    def caps(self, request: BudgetRequest) -> torch.Tensor:
        """int64 ``[batch, kv_heads]``: tokens each head keeps, summing to ``layer_tokens`` where counts allow."""


class Quantization(Policy, Codec):
    """A codec for sealed pages that stores them in fewer bits (see :mod:`kvlib.codec`)."""

    kind = "quantization"

    def salience_scorer(self) -> Eviction | None:
        """The scorer that decides token salience for this codec (its codecs :attr:`~kvlib.codec.PageCodec.uses_salience`)
        where the spec has no eviction policy, whose scores decide otherwise; None (the default):
        the codec reads no salience."""
        return None


class LowRank(Policy, Codec):
    """A codec that stores sealed pages in a lower-rank space (see :mod:`kvlib.codec`); fitted to
    each prompt unless the policy says otherwise (``fits_each_prompt``)."""

    kind = "lowrank"
    fits_each_prompt = True


class Reuse(Policy):
    """Decides what is shared between sequences and requests."""

    kind = "reuse"


class Tiering(Policy):
    """Decides where pages live (device, host, disk) and when they move.

    ``device_pages`` / ``host_pages`` give each layer's page budgets (None: no budget, every page
    on the device / an unbounded host tier). :meth:`leaving_order` is the policy's placement
    rule (a :class:`~kvlib.placement.Placement`): the order in which pages leave the device and
    the host, which the tiered pools apply (:mod:`kvlib.placement`). ``key_summaries`` asks the
    store to keep each page's key min and max on the device; a policy that also chooses the
    pages each step reads is a :class:`PageRetrieval`.
    """

    kind = "tiering"
    key_summaries: ClassVar[bool] = False
    retrieves_pages: ClassVar[bool] = False
    """Whether this is a :class:`PageRetrieval` (chooses the pages some layer calls attend over)."""

    def device_pages(self, num_layers: int, page_bytes: int) -> int | None:
        """Pages of ``page_bytes`` each layer may keep on the device (None: all)."""
        return None

    def host_pages(self, num_layers: int, page_bytes: int) -> int | None:
        """Pages each layer may keep on the host (None: unbounded)."""
        return None

    def disk_directory(self) -> str:
        """The directory of the lmdb disk tier behind the host ("": none)."""
        return ""

    def disk_pages(self, num_layers: int, record_bytes: int) -> int:
        """Pages each layer may keep on disk, as records of ``record_bytes`` (0: no disk tier)."""
        return 0

    def prefetches(self) -> bool:
        """Whether each read of a layer starts fetching the next layer's host and disk pages on a
        background thread (see :mod:`kvlib.storage.pools.page_prefetch`); not by default."""
        return False

    def leaving_order(self, pages: PageStats) -> torch.Tensor:
        """int64 ``[len(pages.ids)]``: the candidate pages' indices in the order they leave
        ``pages.tier``, first to leave first (see :class:`~kvlib.placement.Placement`). By default
        :func:`~kvlib.placement.lowest_score_first`: least recently written until pages are
        ranked."""
        return lowest_score_first(pages)

    def refreshes_ranking(self, tokens_seen: int, query_length: int) -> bool:
        """Whether the layer call that brought the layer to ``tokens_seen`` tokens (``query_length``
        of them new) should re-rank its pages with :meth:`ranking_scores` (never, by default)."""
        return False

    def ranking_scores(self, view: LayerView) -> torch.Tensor:
        """Per-token placement scores ``[batch, kv_heads, slots]``, higher stays on the device
        (asked for only when :meth:`refreshes_ranking` says so)."""
        raise NotImplementedError(f"{type(self).__name__} does not rank pages")

    def arranges_tokens(self, layer_idx: int, query_length: int) -> bool:
        """Whether, after a (non-sparse) call of layer ``layer_idx`` with ``query_length`` new
        tokens per row, the layer's stored tokens are put in the slot order :meth:`arrangement`
        gives (never, by default)."""
        return False

    def arrangement(self, view: LayerView) -> torch.Tensor:
        """The new slot order of each head's stored tokens: int64 ``[batch, kv_heads, slots]``, new
        slot ``i`` takes old slot ``order[..., i]``, every valid slot of ``view`` once, ``-1`` last
        (asked for only when :meth:`arranges_tokens` says so; the store rewrites the heads whose
        order changes, each token keeping its position: :meth:`~kvlib.storage.store.paged_store.PagedStore.arrange`)."""
        raise NotImplementedError(f"{type(self).__name__} does not arrange tokens")


class PageRetrieval(Tiering, abc.ABC):
    """A tiering policy that chooses the pages some layer calls attend over (``quest``).

    The store keeps each page's channel-wise key min and max on the device (``key_summaries``).
    At a layer call :meth:`sparse` accepts, the cache stores the new tokens, hands
    :meth:`select_pages` the query and the bounds of the pages each (row, KV head) holds, and
    attention runs over the chosen pages only, read from whichever tier holds them; nothing is
    evicted, and the next call may choose others. Other calls attend over every page.
    """

    key_summaries = True
    retrieves_pages = True

    @abc.abstractmethod
    def sparse(self, layer_idx: int, query_length: int) -> bool:
        """Whether a call of layer ``layer_idx`` with ``query_length`` new tokens per row attends
        over chosen pages only (:meth:`select_pages`) rather than over all of them."""

    @abc.abstractmethod
    def select_pages(
        self, layer_idx: int, query: torch.Tensor, key_min: torch.Tensor, key_max: torch.Tensor, pages_used: torch.Tensor
    ) -> torch.Tensor:
        """The pages to attend over: int64 ``[batch, kv_heads, k]`` on the CPU, indices into each
        head's block table (page 0 holds its first stored tokens), ascending, ``-1`` last where a
        head chooses fewer than ``k``.

        ``layer_idx``: the layer called. The call follows :meth:`sparse` returning True for
        ``sparse(layer_idx, ...)``; a policy keeping state per layer keys it by ``layer_idx``
        (not by the last :meth:`sparse` call: nothing else tells it the layer).

        ``query`` ``[batch, query_heads, 1, head_dim]``: the call's query after RoPE (query heads
        grouped by KV head, as ``repeat_kv`` lays them out). ``key_min`` / ``key_max`` ``[batch,
        kv_heads, pages, head_dim]``: each held page's channel-wise key minimum and maximum
        (after RoPE), on the store's device. ``pages_used`` int64 ``[batch, kv_heads]``: pages
        each head holds (its newest, holding the current token, is the last; entries past it are
        not pages).
        """

    def expected_pages(self, layer_idx: int) -> torch.Tensor | None:
        """The pages the next sparse call of layer ``layer_idx`` is expected to read, as
        :meth:`select_pages` lists them for the rows of the call just made; asked right after that
        call. With a prefetcher (:meth:`prefetches`) the store starts fetching their host and disk
        copies then, so the copy overlaps the rest of the step (SpeCache's speculative fetch),
        and the next read takes what it brought where the pages are unchanged: a wrong guess
        costs a wasted fetch, never a wrong read. None (the default): no guess, nothing fetched."""
        return None


class CheckpointProjection(abc.ABC):
    """One attention layer's keys and values as a function of what it stores per token instead:
    its *checkpoint*, the ``dim`` channels that enter the layer's key and value projections (the
    attention module's input), in the compute dtype.

    Invariant: :meth:`keys_values` of a token's checkpoint and position equals what the model's
    attention module computes as that token's key (after RoPE) and value, to float rounding."""

    dim: int
    """Channels of a checkpoint."""

    @abc.abstractmethod
    def keys_values(self, checkpoints: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys ``[batch, kv_heads, tokens, head_dim]`` (after RoPE) and values ``[batch, kv_heads,
        tokens, value_dim]`` of ``checkpoints`` ``[batch, tokens, dim]`` at ``positions`` (int64
        ``[batch, tokens]``, the position ids the model gave those tokens)."""


class Recompute(Policy, abc.ABC):
    """Stores what each attention layer's keys and values are computed from instead of them, and
    recomputes them whenever the layer is read: memory per token is the checkpoint's, outputs are
    the exact cache's. It binds to the model's layer modules (their projection weights) when a
    cache is made."""

    kind = "recompute"

    @abc.abstractmethod
    def bind(self, model: torch.nn.Module) -> list[CheckpointProjection]:
        """One projection per KV layer of ``model`` (in KV-layer order), reading its weights in
        place; ``ValueError`` in one line, before any model work, for a model it cannot serve."""


KIND_BASES: dict[str, type[Policy]] = declare_kinds(Eviction, Budget, Quantization, LowRank, Reuse, Tiering, Recompute)
MAX_PER_SPEC: dict[str, int | None] = {
    "eviction": 1,
    "budget": 1,
    "quantization": 1,
    "lowrank": 1,
    "reuse": None,
    "tiering": 1,
    "recompute": 1,
}
"""How many policies of each kind one spec may hold (None: any number)."""

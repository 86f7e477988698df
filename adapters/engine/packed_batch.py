"""A packed ragged batch: the tokens of many sequences in one forward pass, no padding.

The engine lays a step's tokens out on one row (``input_ids [1, tokens]``, ``position_ids`` per
token) as :class:`Segment` s: first one segment with the decoding sequences' single tokens (token
``start + b`` belongs to ``seqs[b]``), then one segment per prefill chunk. A model called with a
:class:`PackedCache` as its cache hands each layer's new keys and values to
:meth:`PackedCache.update`, which appends every segment's tokens to its sequences in the paged
store and publishes a :class:`PackedLayerStep` (through :mod:`~kvlib.adapters.runtime.layer_step`, as
every kvlib cache layer does): the decode group's pages where they lie (one
block table over its rows, ragged lengths per (row, head); no dense copy), each chunk's stored
tokens read into a transient dense workspace (reported as the store's ``peak_workspace``). The
kvlib attention function then lets the step attend, :func:`packed_attention`: each segment attends over its own
sequences' stored tokens (the decode group in one call of the page kernel,
:mod:`~kvlib.kernels.paged_attention`; each chunk causally by stored position through SDPA), and the
outputs are laid back on the packed token axis. The decode group reads densely instead where the
pages cannot be read in place (codecs, a device without the kernel), where the store keeps a
read mirror (``read_cache=True``) and where the attention is one the kernel does not reproduce
(eager attention, attention sinks).

Sliding-window layers (``windows``): a token at position ``q`` sees its own sequence's positions
``q - window + 1 .. q``. A dense read is masked so; the engine frees what left each sequence's
window after every segment's attention (:func:`~kvlib.adapters.runtime.after_attention.drop_behind_window`),
so a decode token, whose sequence holds only the ``window - 1`` positions before it, sees
everything its pages hold, and the page kernel needs no window.

Shared prefixes (``share_prefixes``, Hydragen): where the decode group attends over its pages
and two of its rows begin with the same full pages (the prefix cache attaches them by reference),
its attention is split (:mod:`~kvlib.kernels.shared_prefix`): the shared pages are read once for
the queries of every row that shares them, each row's own pages apart, and the parts merge by
their log-sum-exps (:func:`decode_shared_prefix`), equal to attention over each row's whole table
to float32 rounding. :attr:`PackedCache.decode_reads` counts the (token, KV head) pairs the decode
group's attention read over its pages in the forward pass, either way.

Invariant: after a forward pass, each sequence of a segment holds its previous tokens plus the
segment's tokens, at the positions given; no sequence ever sees another's tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from kvlib.adapters.runtime import layer_step
from kvlib.adapters.runtime.layer_step import AttentionCall, AttentionPath
from kvlib.devices import reads_pages_in_place
from kvlib.kernels.pages import PagedLayer, PageReader
from kvlib.kernels.shared_prefix import PrefixSharing, attend_shared, share_prefixes
from kvlib.storage.layers.read_cache import LayerRead
from kvlib.storage.store.paged_store import PagedStore
from kvlib.storage.store.step_plan import StepPlan


@dataclass
class Segment:
    """Tokens ``start .. start + len(seqs) * length`` of the packed row: ``length`` new tokens for
    each of ``seqs`` (store sequence ids), sequence-major. ``length`` is 1 for the decode group;
    a prefill chunk is one sequence. ``positions``: int64 ``[len(seqs), length]``, the tokens'
    positions (each sequence's stored length onwards)."""

    seqs: list[int]
    start: int
    length: int
    positions: torch.Tensor
    uniform_heads: bool = True
    """Every head of these sequences holds the same tokens (no per-head eviction), so one mask
    row serves all heads."""
    verifying: bool = False
    """A group of draft verifications (each row its last token and a draft of ``length - 1``):
    it attends causally straight over its rows' pages, as the decode group does, where those
    can be read in place (:func:`verify_over_pages`)."""

    @property
    def tokens(self) -> int:
        return len(self.seqs) * self.length


@dataclass
class PackedLayerStep:
    """One layer of a packed forward pass: the key tensor the layer got back from ``update`` (its
    identity marks the attention call) and, per segment after the append, either its pages in
    place (``paged``; its ``reads`` entry is None) or its dense read (``reads``)."""

    cache: PackedCache
    layer_idx: int
    keys: torch.Tensor
    reads: list[LayerRead | None]
    paged: list[PagedLayer | None]
    plan: StepPlan | None = None
    """The decode group's step plan (segment 0; its ``paged`` and ``reads`` entries are then None)."""

    def is_for(self, module: torch.nn.Module, keys: torch.Tensor) -> bool:
        return self.keys is keys and getattr(module, "layer_idx", None) == self.layer_idx

    def attend(self, call: AttentionCall) -> tuple[torch.Tensor, None]:
        """Every segment's attention over its own sequences (:func:`packed_attention`)."""
        return packed_attention(self, call)

    def dense_read(self, index: int) -> LayerRead:
        """Segment ``index``'s stored tokens in dense form: its read, or for a segment published
        as pages a transient gather of them (not kept as a mirror)."""
        read = self.reads[index]
        if read is None:
            read = self.reads[index] = self.cache.store.read(self.layer_idx, self.cache.segments[index].seqs, mirror=False)
        return read


class _PackedLayer(CacheLayerMixin):
    """One layer of a :class:`PackedCache`, as `transformers` inspects it."""

    is_sliding = False
    is_compileable = False

    def __init__(self, cache: PackedCache, layer_idx: int) -> None:
        self.keys = self.values = None
        self._cache = cache
        self.layer_idx = layer_idx

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Nothing to do: the store exists already."""

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, kwargs: dict | None = None, **_
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self._cache.update(key_states, value_states, self.layer_idx, kwargs=kwargs)

    def get_seq_length(self) -> int:
        return 0

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return query_length, 0

    def get_max_length(self) -> int:
        return -1


class PackedCache(Cache):
    """The cache of a packed forward pass over ``store`` (see the module docstring).

    ``after_attention(layer_idx, segment_index, query, read, scaling)`` (optional) is called after
    each segment's attention, ``read`` being the segment's dense read, or None for a decode group
    that attended over its pages; the engine runs per-request eviction and frees what left a
    sliding window there. ``windows``: per layer, its sliding window in tokens, None for a layer
    that sees every position (empty: none slides). ``share_prefixes``: the decode group reads
    full pages its rows share once for all of them (:func:`decode_shared_prefix`) in a layer where
    that saves at least this many (token, KV head) reads (None: never).
    """

    def __init__(
        self,
        store: PagedStore,
        segments: list[Segment],
        after_attention: Callable | None = None,
        windows: Sequence[int | None] = (),
        share_prefixes: int | None = None,
    ) -> None:
        super().__init__(layers=[_PackedLayer(self, i) for i in range(store.num_layers)])
        self.store = store
        self.segments = segments
        self.after_attention = after_attention
        self.windows = tuple(windows)
        self.share_prefixes = share_prefixes
        self.plan: StepPlan | None = None
        """The decode group's step plan for every layer (made at layer 0), or None."""
        self.split: PrefixSharing | None = None
        """The last layer's split of the decode group by shared prefix (the next layer keeps its
        groups where they hold: :func:`~kvlib.kernels.shared_prefix.share_prefixes`'s ``like``);
        None from a layer that found none on: the later layers of the pass do not look."""
        self.decode_reads = 0
        """(token, KV head) pairs the decode group's attention has read over its pages so far in
        this forward pass, over every layer (shared pages once per group where it shared them;
        nothing for a group read densely)."""
        self.verify_plans: dict[int, StepPlan] = {}
        """The verification segments' step plans for every layer (made at layer 0), by segment index."""

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, kwargs: dict | None = None, **_
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append each segment's new keys and values (``[1, kv_heads, tokens, dim]``) to its
        sequences, then publish each segment's pages (the decode group, where it reads them in
        place) or dense read (:func:`~kvlib.adapters.runtime.layer_step.publish`, in ``kwargs``, the
        layer call's attention keyword arguments, when given); returns the inputs (attention
        takes what was published). Every append comes before any read, so a page layout handed
        over stays valid for the call. The decode group's step is planned once for every layer
        at layer 0 where the store can (:meth:`~kvlib.storage.store.paged_store.PagedStore.plan_step`): its
        tokens are then written where the plan puts them and it attends through the plan."""
        if layer_idx == 0:
            self.plan = self._plan_decode_group()
            self.verify_plans = self._plan_verifications()
        plan = self.plan
        planned = {index: plan for index in (0,) if plan is not None} | self.verify_plans
        for index, segment in enumerate(self.segments):
            keys = _segment_tokens(key_states, segment)
            values = _segment_tokens(value_states, segment)
            if index in planned:
                planned[index].pools[layer_idx].format.write_planned(planned[index], layer_idx, keys, values)
            else:
                self.store.append(layer_idx, segment.seqs, keys, values)
        paged = [None if index in planned else self._paged_layer(layer_idx, segment) for index, segment in enumerate(self.segments)]
        reads = [
            None if pages is not None or index in planned else self.store.read(layer_idx, segment.seqs, mirror=segment.length == 1)
            for index, (segment, pages) in enumerate(zip(self.segments, paged))
        ]
        layer_step.publish(PackedLayerStep(self, layer_idx, key_states, reads, paged, plan), kwargs)
        return key_states, value_states

    def _plan_decode_group(self) -> StepPlan | None:
        """The decode group's plan (:meth:`~kvlib.storage.store.paged_store.PagedStore.plan_step`), where the
        first segment is one and its pages are read in place; else None."""
        if not self.segments or self.segments[0].length != 1 or not reads_pages_in_place(self.store.device):
            return None
        return self.store.plan_step(self.segments[0].seqs, 1)

    def _plan_verifications(self) -> dict[int, StepPlan]:
        """Each verification segment's plan (:meth:`~kvlib.storage.store.paged_store.PagedStore.plan_step`
        of its rows and length: its writes and attention bookkept once for every layer), where its
        pages are read in place and the store plans it; a segment left out appends layer by layer.
        Each plan is taken after the decode group's (rows apart), so each holds for this step."""
        if self.store.use_read_cache or not reads_pages_in_place(self.store.device):
            return {}
        plans = {
            index: self.store.plan_step(segment.seqs, segment.length) for index, segment in enumerate(self.segments) if segment.verifying
        }
        return {index: plan for index, plan in plans.items() if plan is not None}

    def _paged_layer(self, layer_idx: int, segment: Segment) -> PagedLayer | None:
        """The decode group's or a verification group's pages in place, when it may attend
        straight over them (no read mirror kept, a device the page kernel runs on, a pool that
        gives its pages); else None."""
        if (segment.length != 1 and not segment.verifying) or self.store.use_read_cache or not reads_pages_in_place(self.store.device):
            return None
        return self.store.paged_layer(layer_idx, segment.seqs)

    def window(self, layer_idx: int) -> int | None:
        """``layer_idx``'s sliding window in tokens, or None where it sees every position."""
        return self.windows[layer_idx] if self.windows else None

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0


def _segment_tokens(states: torch.Tensor, segment: Segment) -> torch.Tensor:
    """``[len(seqs), kv_heads, length, dim]``: the segment's slice of packed ``[1, kv_heads, tokens, dim]``."""
    part = states[0, :, segment.start : segment.start + segment.tokens]
    heads, _, dim = part.shape
    return part.view(heads, len(segment.seqs), segment.length, dim).transpose(0, 1).contiguous()


def packed_attention(step: PackedLayerStep, call: AttentionCall) -> tuple[torch.Tensor, None]:
    """Attention of every segment over its own sequences: ``call.query [1, heads, tokens,
    head_dim]`` in, ``[1, tokens, heads, head_dim]`` out (what `transformers` attention functions
    return). The path is chosen by the rule a drop-in cache layer's call uses
    (:meth:`AttentionCall.path`): a decode group planned for every layer attends
    through its plan, one published as pages straight over them; otherwise its stored tokens are
    read densely and it runs :func:`decode_attention` (SDPA's math for one query per row, several
    times faster on CPU) or the call's inner attention (SDPA, or eager with an additive float
    mask). Each segment's after-attention work follows its attention (``step.cache.after_attention``)."""
    query, kwargs = call.query, call.kwargs
    heads = query.shape[1]
    outputs = []
    for index, (segment, pages) in enumerate(zip(step.cache.segments, step.paged)):
        part = query[0, :, segment.start : segment.start + segment.tokens]
        part = part.view(heads, len(segment.seqs), segment.length, -1).transpose(0, 1)
        verify_plan = step.cache.verify_plans.get(index)
        path = call.path(planned=(index == 0 and step.plan is not None) or verify_plan is not None, over_pages=pages is not None)
        shared = _shared_decode(step, index, path)
        if shared is not None:
            output = decode_shared_prefix(part, shared, segment, kwargs)
            read = None  # attended over the pages: nothing was read
        elif path is AttentionPath.PLANNED and verify_plan is not None:
            output = verify_planned(part, verify_plan, step.layer_idx, segment, kwargs)
            read = None  # attended over the pages: nothing was read
        elif path is AttentionPath.PLANNED:
            scale = kwargs.get("scaling") or part.shape[-1] ** -0.5
            output = step.plan.pools[step.layer_idx].format.attend_planned(
                step.plan, step.layer_idx, part, None, scale, kwargs.get("softcap")
            )
            read = None  # attended over the pages: nothing was read
        elif path is AttentionPath.OVER_PAGES:
            over_pages = verify_over_pages if segment.length > 1 else decode_over_pages
            output = over_pages(part, pages, segment, kwargs)
            read = None  # attended over the pages: nothing was read
        else:
            read = step.dense_read(index)
            visible = visibility(read, segment.positions, heads, segment.uniform_heads, step.cache.window(step.layer_idx))
            if segment.length == 1 and not call.eager and _plain_attention(kwargs):
                output = decode_attention(part, read.keys, read.values, visible, kwargs.get("scaling"))
            else:
                mask = visible
                if call.eager:  # eager attention takes an additive float mask
                    mask = torch.zeros(visible.shape, dtype=part.dtype, device=visible.device)
                    mask.masked_fill_(~visible, torch.finfo(part.dtype).min)
                output, _ = call.inner(call.module, part, read.keys, read.values, mask, **kwargs)
        outputs.append(output.reshape(1, segment.tokens, heads, -1))
        if path is not AttentionPath.DENSE and index == 0 and segment.length == 1:
            step.cache.decode_reads += _decode_reads(step, shared)
        if step.cache.after_attention is not None:
            step.cache.after_attention(step.layer_idx, index, part, read, kwargs.get("scaling"))
    return torch.cat(outputs, dim=1), None


def visibility(read: LayerRead, positions: torch.Tensor, heads: int, uniform_heads: bool, window: int | None = None) -> torch.Tensor:
    """Which stored slots of ``read`` each new token of its rows sees: bool ``[batch, 1 or heads,
    length, slots]`` (one head row when every head holds the same tokens, else one per query head);
    causal by stored position, and within the last ``window`` positions (the token's own
    included) for a sliding-window layer. ``positions``: int64 ``[batch, length]``, the new tokens' positions."""
    positions = positions.to(read.positions.device).view(positions.shape[0], 1, -1, 1)
    stored = read.positions.unsqueeze(2)
    visible = (stored <= positions) & read.valid.unsqueeze(2)
    if window is not None:
        visible &= stored > positions - window
    if uniform_heads:
        return visible[:, :1]
    if visible.shape[1] != heads:
        return visible.repeat_interleave(heads // visible.shape[1], dim=1)
    return visible


def decode_over_pages(query: torch.Tensor, pages: PagedLayer, segment: Segment, kwargs: dict) -> torch.Tensor:
    """The decode group's attention straight over its pages: ``query [batch, heads, 1, head_dim]``
    in, ``[batch, 1, heads, value_dim]`` out. Each row's new token is its newest, so it sees every
    token its row stores (all at positions at or before its own): causal visibility by the group's
    latest position gives exactly that, with each (row, head)'s own length."""
    latest = segment.positions.max().view(1)
    scale = kwargs.get("scaling") or query.shape[-1] ** -0.5
    output = pages.attend(query, visible=None, query_positions=latest, scale=scale, softcap=kwargs.get("softcap"))
    return output.transpose(1, 2)


class SharedDecode(NamedTuple):
    """The decode group's pages of one layer split by shared prefix: the page source its kernel
    reads and the split (:class:`~kvlib.kernels.shared_prefix.PrefixSharing`)."""

    source: PageReader
    sharing: PrefixSharing


def _shared_decode(step: PackedLayerStep, index: int, path: AttentionPath) -> SharedDecode | None:
    """Segment ``index``'s pages split by shared prefix, where the cache shares prefixes, the
    segment is the decode group attending over its pages (through its plan or in place), the
    pool gives its pages to a kernel and two of its rows begin with the same full pages (the
    previous layer's groups kept where they hold; no layer after one whose rows share nothing
    looks); else None."""
    cache = step.cache
    segment = cache.segments[index]
    if cache.share_prefixes is None or index != 0 or segment.length != 1 or len(segment.seqs) < 2 or path is AttentionPath.DENSE:
        return None
    if step.layer_idx > 0 and cache.split is None:
        return None
    pages = step.paged[index]
    if pages is None:
        pages = cache.store.paged_layer(step.layer_idx, segment.seqs)
    cache.split = (
        None
        if pages is None
        else share_prefixes(pages.pages, pages.lengths, cache.store.page_size, like=cache.split, min_saved=cache.share_prefixes)
    )
    return None if cache.split is None else SharedDecode(pages.source, cache.split)


def decode_shared_prefix(query: torch.Tensor, shared: SharedDecode, segment: Segment, kwargs: dict) -> torch.Tensor:
    """The decode group's attention over its pages split by shared prefix
    (:func:`~kvlib.kernels.shared_prefix.attend_shared`): ``query [batch, heads, 1, head_dim]`` in,
    ``[batch, 1, heads, value_dim]`` out; each row sees every token its row stores, as in
    :func:`decode_over_pages`."""
    latest = segment.positions.max().view(1)
    scale = kwargs.get("scaling") or query.shape[-1] ** -0.5
    output = attend_shared(shared.source, query, shared.sharing, query_positions=latest, scale=scale, softcap=kwargs.get("softcap"))
    return output.transpose(1, 2)


def _decode_reads(step: PackedLayerStep, shared: SharedDecode | None) -> int:
    """(token, KV head) pairs the decode group's attention read over its pages in this layer."""
    if shared is not None:
        return shared.sharing.tokens_read()
    return int(step.cache.store.physical_lengths(step.layer_idx, step.cache.segments[0].seqs).sum())


def verify_over_pages(query: torch.Tensor, pages: PagedLayer, segment: Segment, kwargs: dict) -> torch.Tensor:
    """A verification group's attention straight over its pages: ``query [batch, heads, length,
    head_dim]`` in, ``[batch, length, heads, value_dim]`` out, causal per row
    (:func:`verification_mask`)."""
    visible = verification_mask(segment, query.device)
    scale = kwargs.get("scaling") or query.shape[-1] ** -0.5
    output = pages.attend(query, visible=visible, query_positions=None, scale=scale, softcap=kwargs.get("softcap"))
    return output.transpose(1, 2)


def verify_planned(query: torch.Tensor, plan: StepPlan, layer: int, segment: Segment, kwargs: dict) -> torch.Tensor:
    """A planned verification group's attention over its pages once ``plan`` wrote the layer:
    ``query [batch, heads, length, head_dim]`` in, ``[batch, length, heads, value_dim]`` out, causal
    per row (:func:`verification_mask`, as the model's mask ``[batch, 1, length, logical]``)."""
    scale = kwargs.get("scaling") or query.shape[-1] ** -0.5
    mask = verification_mask(segment, query.device).unsqueeze(1)
    return plan.pools[layer].format.attend_planned(plan, layer, query, mask, scale, kwargs.get("softcap"))


def verification_mask(segment: Segment, device: torch.device) -> torch.Tensor:
    """Which logical positions each token of a verification group sees: bool ``[batch, length,
    newest + 1]``. Each row stores its tokens at positions ``0 ..`` its newest (no eviction while
    speculating), the segment's own last, so the token at position ``q`` sees the positions ``<= q``."""
    logical = torch.arange(int(segment.positions.max()) + 1, device=device)
    return logical.view(1, 1, -1) <= segment.positions.to(device).unsqueeze(-1)


def _plain_attention(kwargs: dict) -> bool:
    """Softmax attention with no logit soft-capping, attention sinks or dropout."""
    return kwargs.get("softcap") is None and kwargs.get("s_aux") is None and not kwargs.get("dropout")


def decode_attention(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, visible: torch.Tensor, scaling: float | None
) -> torch.Tensor:
    """One query per row over its stored tokens, grouped-query aware, without repeating keys.

    ``query [batch, heads, 1, head_dim]``, ``keys [batch, kv_heads, slots, head_dim]``, ``values
    [batch, kv_heads, slots, value_dim]``, ``visible`` bool ``[batch, 1 or heads, 1, slots]``;
    query head ``h`` reads KV head ``h // (heads // kv_heads)`` (as ``repeat_kv``). ``scaling``
    defaults to ``head_dim ** -0.5``; softmax in float32. Returns ``[batch, 1, heads, value_dim]``.
    Every row sees at least its own new token, so no softmax row is empty.
    """
    batch, heads, _, dim = query.shape
    kv_heads, slots = keys.shape[1], keys.shape[2]
    group = heads // kv_heads
    scores = torch.matmul(query.reshape(batch, kv_heads, group, dim), keys.transpose(-1, -2))
    scores = scores * (dim**-0.5 if scaling is None else scaling)
    mask = visible.reshape(batch, kv_heads, group, slots) if visible.shape[1] == heads else visible.reshape(batch, 1, 1, slots)
    probabilities = scores.float().masked_fill(~mask, float("-inf")).softmax(-1).to(values.dtype)
    return torch.matmul(probabilities, values).reshape(batch, 1, heads, values.shape[-1])

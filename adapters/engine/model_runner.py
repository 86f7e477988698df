"""The Engine's model runner: one step's chunks through the model as one packed row.

:meth:`ModelRunner.run` packs the chunks (:mod:`kvlib.adapters.engine.packed_batch`: the decode group
as one segment, then one segment per prefill chunk; positions per token, no padding), runs the
model with the LM head only at the last token of each request that completes its tokens, runs
each segment's per-request eviction, the freeing of what left a sliding window and page sealing
after its attention in every layer, and samples each completing request's next token
(:mod:`kvlib.adapters.engine.sampling`).

Speculation: a verifying request (one with a draft) runs its last token then the draft's, in one
segment with the other verifications of its length (the scheduler gives a step's verifications
one length where it can), which attends causally over its rows' pages
(:attr:`~kvlib.adapters.engine.packed_batch.Segment.verifying`); the logits of all of them give
the accepted draft prefix and one more token (:func:`~kvlib.adapters.engine.sampling.verify_draft`),
cut where the request ends (its end-of-sequence token, ``max_new_tokens``). What was not kept is
then truncated from the pages, one call a layer for every request that kept less than it ran
(:meth:`~kvlib.storage.store.paged_store.PagedStore.truncate` with a length per sequence), before
anything indexes them, so no rejected token stays stored.

Invariant: after :meth:`ModelRunner.run`, each request's ``computed`` counts the tokens its
sequence holds (its chunk added; for a verifying request, its last token and the accepted draft
tokens that the output kept), and each request whose last token ran has one more output token
(a verifying request one or more), with its time. Between steps, each sliding-window layer of a sequence that has been
given ``computed`` tokens holds only positions ``computed - window + 1`` onwards (at most
``window - 1`` tokens; :func:`~kvlib.adapters.runtime.after_attention.drop_behind_window`).
"""

from __future__ import annotations

import time
from typing import NamedTuple

import torch

from kvlib.adapters.engine.engine_request import Request
from kvlib.adapters.engine.packed_batch import PackedCache, Segment, visibility
from kvlib.adapters.engine.sampling import next_token, verify_draft
from kvlib.adapters.runtime.after_attention import drop_behind_window, evict, keep_up, make_ring_room
from kvlib.adapters.runtime.layer_step import LayerStep
from kvlib.adapters.runtime.needs import AttentionInputs
from kvlib.codec import Codec
from kvlib.model_shape import KVShape
from kvlib.storage.layers.read_cache import LayerRead
from kvlib.storage.store.paged_store import PagedStore
from kvlib.transformers_compat import cache_argument


class ModelRunner:
    """Runs ``model`` (of KV layout ``shape``: its layers' sliding windows) over ``store``'s
    sequences; ``codec`` (None: raw pages) seals full pages after each segment's attention, as
    ``KVCache.after_attention`` does; ``shared_prefix``: the decode group reads the full pages
    its rows share once for all of them in a layer where that saves at least this many (token, KV
    head) reads (None: never; :class:`~kvlib.adapters.engine.packed_batch.PackedCache`'s ``share_prefixes``)."""

    def __init__(
        self,
        model: torch.nn.Module,
        store: PagedStore,
        shape: KVShape,
        *,
        codec: Codec | None,
        device: torch.device,
        shared_prefix: int | None = None,
    ) -> None:
        self.model = model
        self.store = store
        self.shape = shape
        self.codec = codec
        self.device = device
        self.shared_prefix = shared_prefix
        self.decode_reads = 0
        """(token, KV head) pairs the last run's decode group read over its pages, over every layer."""
        self._segments: list[tuple[Segment, list[Request]]] = []

    def run(self, chunks: list[tuple[Request, int]], drafts: dict[Request, list[int]] | None = None) -> dict[int, list[int]]:
        """One forward pass over ``chunks`` ((request, tokens to run), decodes first); returns the
        tokens produced, per request id. ``drafts``: the draft tokens a verifying request's chunk
        runs after its last token (its chunk is ``1 + len(draft)`` tokens)."""
        drafts = drafts or {}
        decodes = self._decode_order([request for request, tokens in chunks if tokens == 1])
        prefills = [(request, tokens) for request, tokens in chunks if tokens > 1 and request not in drafts]
        verifying: dict[int, list[Request]] = {}  # verifications of one length share a segment
        for request, tokens in chunks:
            if request in drafts:
                verifying.setdefault(tokens, []).append(request)
        ids, positions, segments, start = [], [], [], 0
        groups = ([(decodes, 1)] if decodes else []) + [(requests, tokens) for tokens, requests in verifying.items()]
        groups += [([request], tokens) for request, tokens in prefills]
        for requests, length in groups:
            rows = []
            for request in requests:
                own = length - len(drafts.get(request, ()))
                rows.append(list(range(request.computed, request.computed + length)))
                ids.extend(request.tokens[request.computed : request.computed + own] + drafts.get(request, []))
            segment_positions = torch.tensor(rows, dtype=torch.int64)
            positions.append(segment_positions.flatten())
            uniform = all(request.evictor is None for request in requests)
            verifying = requests[0] in drafts
            segments.append((Segment([r.seq for r in requests], start, length, segment_positions, uniform, verifying), requests))
            start += len(requests) * length
        self._segments = segments
        for request in decodes:  # a held cap kept as a ring drops its oldest tokens before the step, as a KVCache's does
            if request.evictor is not None:
                for layer in range(self.store.num_layers):
                    make_ring_room(request.evictor, self.store, layer, [request.seq], 1, reuse_slots=True)
        finishing, last_index = [], []
        for segment, requests in segments:
            for b, request in enumerate(requests):
                drafted = len(drafts.get(request, ()))
                if segment.length - drafted == request.remaining:
                    finishing.append(request)
                    end = segment.start + (b + 1) * segment.length
                    last_index.extend(range(end - 1 - drafted, end))
        cache = PackedCache(
            self.store, [segment for segment, _ in segments], self._after_attention, self.shape.windows, share_prefixes=self.shared_prefix
        )
        input_ids = torch.tensor([ids], dtype=torch.int64, device=self.device)
        position_ids = torch.cat(positions).unsqueeze(0).to(self.device)
        with torch.inference_mode():
            logits = self.model(
                input_ids=input_ids,
                position_ids=position_ids,
                **cache_argument(cache),
                use_cache=True,
                attention_mask=torch.ones(1, 1, 1, 1, dtype=torch.bool, device=self.device),  # unused: kvlib masks each segment
                logits_to_keep=torch.tensor(last_index, dtype=torch.int64, device=self.device),
            ).logits[0]
        for segment, requests in segments:
            for request in requests:
                request.computed += segment.length
        self.decode_reads = cache.decode_reads
        return self._sample(logits, finishing, drafts)

    def _sample(self, logits: torch.Tensor, finishing: list[Request], drafts: dict[Request, list[int]]) -> dict[int, list[int]]:
        """Each finishing request's next token from its row of ``logits`` (a verifying request's
        tokens from its rows), appended to its output up to where the request ends; a verifying
        request's tokens not kept are truncated from its pages."""
        now = time.perf_counter()
        produced: dict[int, list[int]] = {}
        rolled_back: list[Request] = []
        row = 0
        for request in finishing:
            draft = drafts.get(request, [])
            sampling = {"do_sample": request.do_sample, "temperature": request.temperature, "top_k": request.top_k}
            sampling |= {"top_p": request.top_p, "generator": request.generator}
            if draft:
                tokens = verify_draft(logits[row : row + len(draft) + 1], draft, **sampling)
            else:
                tokens = [next_token(logits[row], **sampling)]
            row += len(draft) + 1
            kept = []
            for token in tokens:
                if request.done:
                    break
                request.output.append(token)
                request.token_times.append(now)
                kept.append(token)
            produced[request.request_id] = kept
            if draft and len(kept) < len(draft) + 1:  # it holds its last token and the draft: keep those the output kept
                request.computed -= len(draft) + 1 - len(kept)
                rolled_back.append(request)
        if rolled_back:  # one truncation a layer for every request that kept less than it ran
            seqs, lengths = [request.seq for request in rolled_back], [request.computed for request in rolled_back]
            for layer in range(self.store.num_layers):
                self.store.truncate(layer, seqs, lengths)
        return produced

    def _decode_order(self, decodes: list[Request]) -> list[Request]:
        """The decode group in the order of the store's read mirror, then the requests new to it:
        the mirror then only appends rows (finished ones already left it)."""
        mirrored = {seq: rank for rank, seq in enumerate(self.store.mirrored_rows(0))}
        return sorted(decodes, key=lambda request: mirrored.get(request.seq, len(mirrored)))

    def _after_attention(self, layer: int, index: int, query: torch.Tensor, read: LayerRead | None, scaling: float | None) -> None:
        """After a segment's attention in ``layer``: :func:`~kvlib.adapters.runtime.after_attention.keep_up`
        with the runner's steps (per-request eviction, freeing what left a sliding window, sealing
        full pages; no codec learns, no tiering, prefix indexing is the scheduler's). ``read``: the
        segment's dense read, or None where it attended over its pages."""
        keep_up(self, SegmentAttention(layer, index, query, read, scaling), read)

    def layers_to_seal(self, call: SegmentAttention) -> list[int]:
        return [call.layer]

    def evict(self, call: SegmentAttention) -> None:
        """Each request of the segment with an eviction spec scores its row of the layer and
        compacts it; rows without one are not read. The row is its slice of ``read``, or, after
        attention over the pages, its positions, with attention weights from its pages and, when
        it compacts with a policy that scores with keys or values (``reads_kv``), a transient dense
        read of that row. A row whose pages cannot be read in place is read densely. Returns None:
        each request has its own evictor, and no codec here reads salience."""
        layer, query, read = call.layer, call.query, call.read
        segment, requests = self._segments[call.index]
        for b, request in enumerate(requests):
            if request.evictor is None:
                continue
            rows = [request.seq]
            pages = None if read is not None else self.store.paged_layer(layer, rows)
            if pages is not None:  # causal by the row's own positions: no mask needed
                row, mask = self.store.read_positions(layer, rows), None
            else:
                row = LayerRead(*(t[b : b + 1] for t in read)) if read is not None else self.store.read(layer, rows, mirror=False)
                mask = visibility(row, segment.positions[b : b + 1], query.shape[1], False, self.shape.window(layer))
            step = LayerStep(None, layer, row, request.computed, segment.length, False, paged=pages)
            inputs = AttentionInputs(query[b : b + 1], mask, None, call.scaling, None)
            evict(request.evictor, self.store, rows, step, inputs, torch.zeros(1, dtype=torch.int64, device=self.device), reuse_slots=True)

    def slide(self, call: SegmentAttention) -> None:
        """Free the tokens of a sliding-window layer that left the window of each of the segment's
        sequences once it has seen the segment's tokens: the rows without eviction in one
        compaction, each evicting row with its own evictor (its per-slot state follows).
        Returns None: the rows move by several layouts, and nothing after it reads them."""
        window = self.shape.window(call.layer)
        if window is None:
            return
        segment, requests = self._segments[call.index]
        plain = [request for request in requests if request.evictor is None]
        groups = [(plain, None)] if plain else []
        groups += [([request], request.evictor) for request in requests if request.evictor is not None]
        for group, evictor in groups:
            seen = torch.tensor([request.computed + segment.length for request in group], dtype=torch.int64)
            drop_behind_window(self.store, evictor, call.layer, [request.seq for request in group], window, seen, reuse_slots=True)

    def arrange(self, call: SegmentAttention, stored: LayerRead | None) -> bool:
        return False

    def seal(self, call: SegmentAttention, layers: list[int], salience: object) -> None:
        """Seal the full pages of the segment's sequences in ``layers`` (with the engine's codec)."""
        if self.codec is not None:
            for layer in layers:
                self.store.seal(layer, self._segments[call.index][0].seqs)

    def rank(self, call: SegmentAttention, stored: LayerRead | None) -> None:
        return None

    def index(self, call: SegmentAttention) -> None:
        return None


class SegmentAttention(NamedTuple):
    """One segment's attention in one layer, as the work after it sees it: the layer, the
    segment's index in the step, its queries ``[rows, heads, length, head_dim]``, its dense read
    (None: it attended over its pages) and the attention's scale."""

    layer: int
    index: int
    query: torch.Tensor
    read: LayerRead | None
    scaling: float | None

"""The Triton kernels of :mod:`kvlib.kernels.paged_attention_triton`: split-K attention of a few queries
per (row, KV head) over its pages, the merge of the splits, and the scores of one tile per slot.

Layout (every tensor contiguous, on the arenas' device):

- ``query [pairs, ROWS, HEAD_DIM]`` (any float dtype, read as float32): the GQA group of one
  (row, KV head) ``pair = b * KV_HEADS + h`` as one tile of ``ROWS = group * QUERIES`` query
  rows, row ``r`` being query ``r % QUERIES`` of the group's ``r // QUERIES``-th head, so each
  key and value is loaded once for the group;
- ``pages`` int64 ``[pairs, max_pages]``, ``lengths`` int64 ``[pairs]``, ``positions`` int64
  ``[capacity, PAGE_SIZE]``; visibility from ``visible`` uint8 ``[batch, QUERIES, logical]`` at
  each token's position, or (``CAUSAL``) ``0 <= position <= query_positions[q]``;
- keys and values through tile loaders ``LOAD_KEYS`` / ``LOAD_VALUES`` with their tuples of
  tensors (``key_tensors`` / ``value_tensors``) and of constexpr params (``KEY_PARAMS`` /
  ``VALUE_PARAMS``; :mod:`kvlib.kernels.triton_tiles`).

:func:`attend_splits` runs one program per (pair, split): split ``s`` covers the pair's tokens
``[s * split_tokens, (s + 1) * split_tokens)`` (cut at its length), ``BLOCK_N`` tokens per step
(a tile may span pages: each token finds its own page), scores ``scale * q.k`` (products in
``DOT``, :mod:`kvlib.kernels.triton_products`), optionally soft-capped, ``-inf`` where unseen, folded
into a running max, sum and accumulator (FlashAttention's online softmax). With one split it writes the output (``acc /
sum``, 0 for a row that saw nothing, in the output's dtype); with several, each split's
normalized float32 output and its log-sum-exp (``-inf`` for nothing seen), which
:func:`merge_splits` combines: ``out = sum_s exp(lse_s - M) o_s / sum_s exp(lse_s - M)``.
With ``WITH_LSE`` each query row's log-sum-exp over all its tokens goes to ``lse [pairs, ROWS]``
too (float32, ``-inf`` for nothing seen; ``M + log(sum_s exp(lse_s - M))`` after a merge): a
partial attention to merge with another (:mod:`kvlib.kernels.shared_prefix`).
"""

from __future__ import annotations

import triton
import triton.language as tl

from kvlib.kernels.triton_products import split_dot


@triton.jit
def soft_cap(scores, softcap):
    """``softcap * tanh(scores / softcap)``, through ``exp(-2|x|)`` (no overflow for any score)."""
    x = scores / softcap
    decay = tl.exp(-2.0 * tl.abs(x))
    magnitude = (1.0 - decay) / (1.0 + decay)
    return softcap * tl.where(x < 0, -magnitude, magnitude)


@triton.jit
def tile_scores(
    grouped,
    pair,
    token,
    length,
    pages,
    max_pages,
    positions,
    visible,
    query_positions,
    logical,
    scale,
    softcap,
    key_tensors,
    LOAD_KEYS: tl.constexpr,
    KEY_PARAMS: tl.constexpr,
    KV_HEADS: tl.constexpr,
    QUERIES: tl.constexpr,
    ROWS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
    CAUSAL: tl.constexpr,
    SOFTCAP: tl.constexpr,
    DOT: tl.constexpr,
):
    """``(scores, page, slot, stored)`` of the tokens ``token [BLOCK_N]`` of ``pair``: float32
    ``[BLOCK_M, BLOCK_N]`` scores of the query rows ``grouped`` (float32 ``[BLOCK_M, BLOCK_D]``),
    ``-inf`` where a row does not see a token (unseen, past ``length``, a padding row), and each
    token's page id, slot and whether it is stored (below ``length``)."""
    stored = token < length
    page = tl.load(pages + pair * max_pages + token // PAGE_SIZE, mask=stored, other=0)
    slot = token % PAGE_SIZE
    keys = LOAD_KEYS(page, slot, stored, key_tensors, KEY_PARAMS, HEAD_DIM, PAGE_SIZE, BLOCK_D, DOT)
    scores = split_dot(grouped, tl.trans(keys), DOT) * scale
    if SOFTCAP:
        scores = soft_cap(scores, softcap)
    row = tl.arange(0, BLOCK_M)
    real = row < ROWS
    query = row % QUERIES
    # no ``other=`` on this load or the next: Triton 3.2's layout pass rejects it on a vector broadcast later
    position = tl.where(stored, tl.load(positions + page * PAGE_SIZE + slot, mask=stored), -1)
    if CAUSAL:
        last = tl.load(query_positions + query)  # query < QUERIES in padding rows too
        seen = (position[None, :] >= 0) & (position[None, :] <= last[:, None])
    else:
        inside = (position >= 0) & (position < logical)
        mask_rows = ((pair // KV_HEADS) * QUERIES + query).to(tl.int64) * logical
        seen = tl.load(visible + mask_rows[:, None] + position[None, :], mask=real[:, None] & inside[None, :], other=0) != 0
    seen = seen & stored[None, :] & real[:, None]
    return tl.where(seen, scores, float("-inf")), page, slot, stored


@triton.jit
def grouped_queries(query, pair, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """float32 ``[BLOCK_M, BLOCK_D]``: the query rows of ``pair``, 0 in padding rows and channels."""
    row = tl.arange(0, BLOCK_M)
    channel = tl.arange(0, BLOCK_D)
    offsets = (pair * ROWS + row)[:, None] * HEAD_DIM + channel[None, :]
    return tl.load(query + offsets, mask=(row < ROWS)[:, None] & (channel < HEAD_DIM)[None, :], other=0.0).to(tl.float32)


@triton.jit
def attend_splits(
    query,
    pages,
    max_pages,
    lengths,
    positions,
    visible,
    query_positions,
    logical,
    out,
    partial,
    partial_lse,
    lse_out,
    split_tokens,
    scale,
    softcap,
    key_tensors,
    value_tensors,
    LOAD_KEYS: tl.constexpr,
    KEY_PARAMS: tl.constexpr,
    LOAD_VALUES: tl.constexpr,
    VALUE_PARAMS: tl.constexpr,
    KV_HEADS: tl.constexpr,
    QUERIES: tl.constexpr,
    ROWS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    VALUE_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_V: tl.constexpr,
    CAUSAL: tl.constexpr,
    SOFTCAP: tl.constexpr,
    DOT: tl.constexpr,
    SPLIT: tl.constexpr,
    WITH_LSE: tl.constexpr,
):
    """One (pair, split) of the attention (module docstring): ``out [pairs, ROWS, VALUE_DIM]``
    (and with ``WITH_LSE`` ``lse_out [pairs, ROWS]``) when not ``SPLIT``, else ``partial [pairs,
    splits, ROWS, VALUE_DIM]`` and ``partial_lse [pairs, splits, ROWS]`` (float32)."""
    pair = tl.program_id(0)
    split = tl.program_id(1)
    grouped = grouped_queries(query, pair, ROWS, HEAD_DIM, BLOCK_M, BLOCK_D)
    first = split * split_tokens
    end = tl.minimum(first + split_tokens, tl.load(lengths + pair).to(tl.int32))
    running_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    running_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_V], tl.float32)
    for start in range(first, end, BLOCK_N):
        scores, page, slot, stored = tile_scores(
            grouped,
            pair,
            start + tl.arange(0, BLOCK_N),
            end,
            pages,
            max_pages,
            positions,
            visible,
            query_positions,
            logical,
            scale,
            softcap,
            key_tensors,
            LOAD_KEYS,
            KEY_PARAMS,
            KV_HEADS,
            QUERIES,
            ROWS,
            HEAD_DIM,
            PAGE_SIZE,
            BLOCK_M,
            BLOCK_D,
            CAUSAL,
            SOFTCAP,
            DOT,
        )
        new_max = tl.maximum(running_max, tl.max(scores, 1))
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)  # nothing seen yet: every weight is exp(-inf) = 0
        weights = tl.exp(scores - shift[:, None])
        rescale = tl.exp(running_max - shift)
        running_sum = running_sum * rescale + tl.sum(weights, 1)
        values = LOAD_VALUES(page, slot, stored, value_tensors, VALUE_PARAMS, VALUE_DIM, PAGE_SIZE, BLOCK_V, DOT)
        acc = acc * rescale[:, None] + split_dot(weights, values, DOT)
        running_max = new_max
    row = tl.arange(0, BLOCK_M)
    channel = tl.arange(0, BLOCK_V)
    written = (row < ROWS)[:, None] & (channel < VALUE_DIM)[None, :]
    seen_any = running_sum > 0
    inverse = tl.where(seen_any, 1.0 / tl.where(seen_any, running_sum, 1.0), 0.0)
    if SPLIT:
        place = (pair * tl.num_programs(1) + split) * ROWS + row
        tl.store(partial + place[:, None] * VALUE_DIM + channel[None, :], acc * inverse[:, None], mask=written)
        lse = tl.where(seen_any, running_max + tl.log(tl.where(seen_any, running_sum, 1.0)), float("-inf"))
        tl.store(partial_lse + place, lse, mask=row < ROWS)
    else:
        place = (pair * ROWS + row)[:, None] * VALUE_DIM + channel[None, :]
        tl.store(out + place, (acc * inverse[:, None]).to(out.dtype.element_ty), mask=written)
        if WITH_LSE:
            lse = tl.where(seen_any, running_max + tl.log(tl.where(seen_any, running_sum, 1.0)), float("-inf"))
            tl.store(lse_out + pair * ROWS + row, lse, mask=row < ROWS)


@triton.jit
def merge_splits(
    partial,
    partial_lse,
    out,
    lse_out,
    splits,
    ROWS: tl.constexpr,
    VALUE_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_V: tl.constexpr,
    WITH_LSE: tl.constexpr,
):
    """One pair's output from its splits' outputs and log-sum-exps (module docstring), in
    ``out``'s dtype; with ``WITH_LSE`` its rows' log-sum-exps in ``lse_out [pairs, ROWS]``."""
    pair = tl.program_id(0)
    row = tl.arange(0, BLOCK_M)
    channel = tl.arange(0, BLOCK_V)
    written = (row < ROWS)[:, None] & (channel < VALUE_DIM)[None, :]
    best = tl.full([BLOCK_M], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_V], tl.float32)
    for split in range(0, splits):
        place = (pair * splits + split) * ROWS + row
        lse = tl.load(partial_lse + place, mask=row < ROWS, other=float("-inf"))
        part = tl.load(partial + place[:, None] * VALUE_DIM + channel[None, :], mask=written, other=0.0)
        new_best = tl.maximum(best, lse)
        shift = tl.where(new_best == float("-inf"), 0.0, new_best)
        weight = tl.exp(lse - shift)
        rescale = tl.exp(best - shift)
        total = total * rescale + weight
        acc = acc * rescale[:, None] + part * weight[:, None]
        best = new_best
    inverse = tl.where(total > 0, 1.0 / tl.where(total > 0, total, 1.0), 0.0)
    place = (pair * ROWS + row)[:, None] * VALUE_DIM + channel[None, :]
    tl.store(out + place, (acc * inverse[:, None]).to(out.dtype.element_ty), mask=written)
    if WITH_LSE:
        lse = tl.where(total > 0, best + tl.log(tl.where(total > 0, total, 1.0)), float("-inf"))
        tl.store(lse_out + pair * ROWS + row, lse, mask=row < ROWS)


@triton.jit
def score_tiles(
    query,
    pages,
    max_pages,
    lengths,
    positions,
    visible,
    query_positions,
    logical,
    scores,
    slots,
    scale,
    softcap,
    key_tensors,
    LOAD_KEYS: tl.constexpr,
    KEY_PARAMS: tl.constexpr,
    KV_HEADS: tl.constexpr,
    QUERIES: tl.constexpr,
    ROWS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    CAUSAL: tl.constexpr,
    SOFTCAP: tl.constexpr,
    DOT: tl.constexpr,
):
    """One (pair, tile of ``BLOCK_N`` slots): the scores of the pair's query rows against its
    slots' tokens into ``scores`` float32 ``[pairs, ROWS, slots]`` (slot ``j * PAGE_SIZE + t``
    is slot ``t`` of the pair's ``j``-th page; ``-inf`` unseen and past its length)."""
    pair = tl.program_id(0)
    token = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    grouped = grouped_queries(query, pair, ROWS, HEAD_DIM, BLOCK_M, BLOCK_D)
    length = tl.load(lengths + pair).to(tl.int32)
    tile, page, slot, stored = tile_scores(
        grouped,
        pair,
        token,
        length,
        pages,
        max_pages,
        positions,
        visible,
        query_positions,
        logical,
        scale,
        softcap,
        key_tensors,
        LOAD_KEYS,
        KEY_PARAMS,
        KV_HEADS,
        QUERIES,
        ROWS,
        HEAD_DIM,
        PAGE_SIZE,
        BLOCK_M,
        BLOCK_D,
        CAUSAL,
        SOFTCAP,
        DOT,
    )
    row = tl.arange(0, BLOCK_M)
    place = (pair * ROWS + row)[:, None].to(tl.int64) * slots + token[None, :]
    tl.store(scores + place, tile, mask=(row < ROWS)[:, None] & (token < slots)[None, :])

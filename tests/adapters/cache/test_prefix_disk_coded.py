"""Coded prefixes on disk: a cache with a quantization codec writes its prompt blocks to the disk
tier as the codec's encoded fields, and a store reading them back (another store on the same
directory: another process's view) gives the same tokens as the in-memory prefix hit and as no
reuse with the same codec; the records hold about the encoded bytes, plain or entropy-coded."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import kvlib
from kvlib.storage.records.prefix_block_record import HEADER
from kvlib.storage.tiers.disk_tier import DiskTier
from kvlib.transformers_compat import cache_argument
from tests.adapters.conftest import PAD, build_model

SPEC = "kivi(bits=4)"


def generate(
    model: torch.nn.Module, prompt: torch.Tensor, store: kvlib.PrefixStore | None, new_tokens: int = 8
) -> tuple[torch.Tensor, int]:
    """Greedy output of a ``SPEC`` cache (primed from ``store`` if given) and the tokens it reused."""
    cache = kvlib.make_cache(model, SPEC, reuse=store, prompt=prompt) if store is not None else kvlib.make_cache(model, SPEC)
    reused = cache.get_seq_length()
    out = model.generate(prompt, **cache_argument(cache), max_new_tokens=new_tokens, do_sample=False, pad_token_id=PAD)
    return out, reused


@pytest.mark.parametrize("entropy", [False, True])
def test_coded_prefix_restored_from_disk_gives_the_same_tokens(tmp_path: Path, entropy: bool) -> None:
    model = build_model("llama")
    prompt = torch.randint(3, 60, (1, 70), generator=torch.Generator().manual_seed(0))
    plain, _ = generate(model, prompt, None)
    disk = DiskTier(tmp_path, capacity_bytes=2**26, entropy=entropy)
    writer = kvlib.PrefixStore(model, capacity_bytes=2**24, disk=disk)
    first, reused = generate(model, prompt, writer)
    assert reused == 0 and torch.equal(first, plain)
    assert disk.stats()["writes"] == 4  # 70 tokens: four full 16-token blocks
    in_memory, reused = generate(model, prompt, writer)
    assert reused == 64 and torch.equal(in_memory, plain)
    reader = kvlib.PrefixStore(model, capacity_bytes=2**24, disk=disk)
    from_disk, reused = generate(model, prompt, reader)
    assert reused == 64 and disk.stats()["reads"] == 4 and disk.stats()["corrupt"] == 0
    assert torch.equal(from_disk, plain)


def test_coded_records_hold_the_encoded_bytes(tmp_path: Path) -> None:
    """A plain record is the pages' encoded bytes plus a header, the token ids, padding and a
    digest; far below the same block in the compute dtype."""
    model = build_model("llama")
    prompt = torch.randint(3, 60, (1, 40), generator=torch.Generator().manual_seed(1))
    disk = DiskTier(tmp_path, capacity_bytes=2**26)
    store = kvlib.PrefixStore(model, capacity_bytes=2**24, disk=disk)
    generate(model, prompt, store, new_tokens=1)
    namespace = next(iter(store.stores))
    pools = store.stores[namespace].pools
    heads = store.stores[namespace].tables[0].num_heads
    encoded = sum(pool.codec.page_bytes() for pool in pools) * heads
    raw = sum(pool.kv_page_bytes for pool in pools) * heads
    sizes = [len(disk.raw(key)) for key in disk.keys()]
    assert len(sizes) == 2
    overhead = HEADER.size + 8 * 16 + 8 + 8 * 6 * len(pools)  # header, token ids, digest, padding at most
    assert all(encoded <= size <= encoded + overhead for size in sizes)
    assert max(sizes) < raw / 3


@pytest.mark.parametrize("entropy", [False, True])
def test_smollm2_coded_prefix_from_disk_gives_the_same_tokens(tmp_path: Path, smollm2, entropy: bool) -> None:
    model, tokenizer = smollm2.model, smollm2.tokenizer
    text = "The lighthouse keeper counted the ships that passed each night and wrote their names in a small book. " * 3
    prompt = torch.tensor([tokenizer.encode(text, bos=True)])
    blocks = (prompt.shape[1] - 1) // 16

    def run(store: kvlib.PrefixStore | None) -> tuple[torch.Tensor, int]:
        cache = kvlib.make_cache(model, SPEC, reuse=store, prompt=prompt) if store is not None else kvlib.make_cache(model, SPEC)
        reused = cache.get_seq_length()
        out = model.generate(prompt, **cache_argument(cache), max_new_tokens=6, do_sample=False, pad_token_id=tokenizer.pad_token_id)
        return out, reused

    plain, _ = run(None)
    disk = DiskTier(tmp_path, capacity_bytes=2**28, entropy=entropy)
    writer = kvlib.PrefixStore(model, capacity_bytes=2**26, disk=disk)
    assert torch.equal(run(writer)[0], plain) and disk.stats()["writes"] == blocks
    in_memory, reused = run(writer)
    assert reused == 16 * blocks and torch.equal(in_memory, plain)
    from_disk, reused = run(kvlib.PrefixStore(model, capacity_bytes=2**26, disk=disk))
    assert reused == 16 * blocks and disk.stats()["reads"] == blocks and torch.equal(from_disk, plain)

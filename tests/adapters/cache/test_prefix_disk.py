"""The persistent prefix cache: a second process reuses the prefixes a first one wrote to the
lmdb disk tier, with identical output; a corrupted record is recomputed; another model's
directory, or the directory of a model one weight away, is never mistaken for this one's; a
directory that cannot hold a tier leaves the store in memory, with one warning (damaged
directories: test_prefix_disk_damage.py). Each process is a child forked from one server that
imported torch and kvlib once (:class:`~tests.fork_server.ForkServer`)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvlib.storage.tiers.disk_tier import DiskTier
from tests.fork_server import ForkServer

SERVER = """
import kvlib
from kvlib.transformers_compat import cache_argument
from tests.adapters.conftest import build_model, edit_one_weight, PAD


def run(directory, family, weights):
    model = build_model(family)
    if weights == "edited":
        edit_one_weight(model)
    prompt = torch.randint(3, 60, (1, 70), generator=torch.Generator().manual_seed(0))
    store = kvlib.PrefixStore(model, capacity_bytes=2**24, disk=directory)
    cache = kvlib.make_cache(model, reuse=store, prompt=prompt)
    reused = cache.get_seq_length()
    out = model.generate(prompt, **cache_argument(cache), max_new_tokens=8, do_sample=False, pad_token_id=PAD)
    same = torch.equal(out, model.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=PAD))
    return {"reused": reused, "same": same, "disk": store.disk.stats()}


def ready():
    for family in ("default", "llama"):  # a warm-up the children inherit (no prefix store, no disk tier here)
        model = build_model(family)
        model.generate(torch.ones(1, 20, dtype=torch.long), **cache_argument(kvlib.make_cache(model)), max_new_tokens=2, do_sample=False, pad_token_id=PAD)
    return "ready"


def serve(request):
    return run(*request)
"""


class Processes:
    """:meth:`run` looks up a prompt's prefixes in a directory and generates, in a new child
    process each time (:class:`~tests.fork_server.ForkServer`: the children share nothing but what
    the server did before forking, which touched no prefix store and no disk tier)."""

    def __init__(self) -> None:
        self.server = ForkServer(SERVER)

    def run(self, directory: Path, family: str = "default", weights: str = "as loaded") -> dict:
        """What a new process reports after generating with a prefix store over ``directory``:
        the tokens it reused, whether its output equals a cache-free ``generate``, its disk
        tier's counters; ``family`` and ``weights`` (``"edited"``: one value changed) pick the model."""
        outcome = self.server.ask([str(directory), family, weights])
        assert outcome["exit"] == 0, outcome
        return outcome["result"]

    def close(self) -> None:
        self.server.close()


@pytest.fixture(scope="module")
def processes() -> Iterator[Processes]:
    server = Processes()
    yield server
    server.close()


def test_a_new_process_reuses_what_an_earlier_one_persisted(processes: Processes, tmp_path: Path) -> None:
    first = processes.run(tmp_path)
    assert first == {"reused": 0, "same": True, "disk": first["disk"]} and first["disk"]["writes"] == 4
    second = processes.run(tmp_path)
    assert second["reused"] == 64 and second["same"] and second["disk"]["reads"] == 4 and second["disk"]["writes"] == 0


def test_a_corrupted_record_is_recomputed_and_another_models_directory_is_ignored(processes: Processes, tmp_path: Path) -> None:
    processes.run(tmp_path)
    tier = DiskTier(tmp_path, capacity_bytes=2**26)
    keys = sorted(tier.keys(), key=lambda key: len(tier.raw(key)))
    record = bytearray(tier.raw(keys[0]))
    record[len(record) // 2] ^= 0xFF  # a flipped byte in the page data
    tier.put(keys[0], bytes(record))
    tier.close()
    damaged = processes.run(tmp_path)
    assert damaged["same"] and damaged["disk"]["corrupt"] == 1 and damaged["reused"] < 64
    other = processes.run(tmp_path, family="llama")  # same directory, another model: nothing found
    assert other["reused"] == 0 and other["same"] and other["disk"]["reads"] == 0


def test_a_process_with_one_weight_edited_reuses_nothing_from_the_originals_directory(processes: Processes, tmp_path: Path) -> None:
    """This process writes the original model's prefixes; another process, whose model has one
    value edited in the middle of one tensor, finds none of them (a fresh prefill, its own
    output) and writes its own beside them; an unchanged reload here still reuses the original's."""
    import torch

    import kvlib
    from kvlib.transformers_compat import cache_argument
    from tests.adapters.conftest import PAD, build_model

    model = build_model("default")
    prompt = torch.randint(3, 60, (1, 70), generator=torch.Generator().manual_seed(0))  # the subprocess's prompt
    writer = kvlib.PrefixStore(model, capacity_bytes=2**24, disk=DiskTier(tmp_path, capacity_bytes=2**26))
    cache = kvlib.make_cache(model, reuse=writer, prompt=prompt)
    model.generate(prompt, **cache_argument(cache), max_new_tokens=2, do_sample=False, pad_token_id=PAD)
    assert writer.disk.stats()["writes"] == 4
    writer.disk.close()
    edited = processes.run(tmp_path, weights="edited")
    assert edited["reused"] == 0 and edited["same"] and edited["disk"]["reads"] == 0 and edited["disk"]["writes"] == 4
    reloaded = build_model("default")
    reader = kvlib.PrefixStore(reloaded, capacity_bytes=2**24, disk=DiskTier(tmp_path, capacity_bytes=2**26))
    assert kvlib.make_cache(reloaded, reuse=reader, prompt=prompt).get_seq_length() == 64
    reader.disk.close()


def test_loading_from_disk_never_evicts_what_the_lookup_found(tmp_path: Path) -> None:
    """A memory budget of one and a half blocks with four on disk: every block the lookup
    finds or loads stays alive until attached (they are acquired as they are found)."""
    import torch

    import kvlib
    from kvlib.transformers_compat import cache_argument
    from tests.adapters.conftest import PAD, build_model

    model = build_model("default")
    prompt = torch.randint(3, 60, (1, 70), generator=torch.Generator().manual_seed(0))
    disk = DiskTier(tmp_path, capacity_bytes=2**26)
    writer = kvlib.PrefixStore(model, capacity_bytes=2**24, disk=disk)
    cache = kvlib.make_cache(model, reuse=writer, prompt=prompt)
    model.generate(prompt, **cache_argument(cache), max_new_tokens=2, do_sample=False, pad_token_id=PAD)
    block = next(iter(writer.index.entries.values())).nbytes
    reader = kvlib.PrefixStore(model, capacity_bytes=block * 3 // 2, disk=disk)
    cache = kvlib.make_cache(model, reuse=reader, prompt=prompt)
    assert cache.get_seq_length() == 64
    out = model.generate(prompt, **cache_argument(cache), max_new_tokens=6, do_sample=False, pad_token_id=PAD)
    assert torch.equal(out, model.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=PAD))
    cache.reset()
    assert reader.stats()["bytes"] <= block * 3 // 2  # once released, the budget holds again


def test_blocks_past_the_disk_tiers_capacity_are_left_out_with_one_warning(tmp_path: Path) -> None:
    """A tier holding two and a half records and a prompt of four full blocks: the first two
    are written, with one warning naming the sizes; a tier smaller than one record takes none."""
    import warnings

    import pytest
    import torch

    import kvlib
    from kvlib.transformers_compat import cache_argument
    from tests.adapters.conftest import PAD, build_model

    model = build_model("default")
    prompt = torch.randint(3, 60, (1, 70), generator=torch.Generator().manual_seed(0))

    def prefill(capacity: int, directory: Path) -> tuple[kvlib.PrefixStore, DiskTier]:
        disk = DiskTier(directory, capacity_bytes=capacity)
        store = kvlib.PrefixStore(model, capacity_bytes=2**24, disk=disk)
        cache = kvlib.make_cache(model, reuse=store, prompt=prompt)
        model.generate(prompt, **cache_argument(cache), max_new_tokens=2, do_sample=False, pad_token_id=PAD)
        return store, disk

    probe, _ = prefill(2**26, tmp_path / "probe")
    record = probe._record_layout(next(iter(probe.stores))).plain_size
    with pytest.warns(
        RuntimeWarning,
        match=rf"4 prompt blocks need {4 * record} bytes on disk, more"
        rf" than the disk tier's capacity of {record * 5 // 2} bytes: only the first 2",
    ):
        store, disk = prefill(record * 5 // 2, tmp_path / "two")
    assert len(disk.keys()) == 2 and disk.stats()["writes"] == 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once per store
        cache = kvlib.make_cache(model, reuse=store, prompt=torch.cat([prompt, prompt], 1))
        model.generate(torch.cat([prompt, prompt], 1), **cache_argument(cache), max_new_tokens=1, do_sample=False, pad_token_id=PAD)
    with pytest.warns(RuntimeWarning, match=r"only the first 0 are written"):
        _, disk = prefill(record - 1, tmp_path / "none")
    assert disk.keys() == []


def test_a_directory_that_cannot_hold_a_tier_leaves_prefixes_in_memory(tmp_path: Path) -> None:
    import kvlib
    from tests.adapters.conftest import build_model

    (tmp_path / "file").write_bytes(b"")
    with pytest.warns(UserWarning, match="cannot create the directory .*prefixes stay in memory") as caught:
        store = kvlib.PrefixStore(build_model("llama"), capacity_bytes=2**20, disk=tmp_path / "file" / "prefixes")
    assert store.disk is None and len(caught) == 1


def test_a_run_of_blocks_restored_from_disk_grows_each_arena_once(tmp_path: Path, monkeypatch) -> None:
    """Fifty blocks of two heads on disk (100 pages a layer, beyond a fresh arena's 64), restored
    into a fresh store: each layer's arena grows once for the run (block by block it grew each
    time the blocks outran it, copying itself each time)."""
    import torch

    import kvlib
    from kvlib.storage.pools.page_pool import PagePool
    from kvlib.transformers_compat import cache_argument
    from tests.adapters.conftest import PAD, build_model

    model = build_model("default")
    prompt = torch.randint(3, 60, (1, 810), generator=torch.Generator().manual_seed(1))
    disk = DiskTier(tmp_path, capacity_bytes=2**28)
    writer = kvlib.PrefixStore(model, capacity_bytes=2**28, disk=disk)
    cache = kvlib.make_cache(model, reuse=writer, prompt=prompt)
    model.generate(prompt, **cache_argument(cache), max_new_tokens=1, do_sample=False, pad_token_id=PAD)
    assert disk.stats()["writes"] == 50
    grows: list[int] = []
    original = PagePool._grow

    def counted(pool: PagePool, min_capacity: int) -> None:
        grows.append(id(pool))
        original(pool, min_capacity)

    monkeypatch.setattr(PagePool, "_grow", counted)
    reader = kvlib.PrefixStore(model, capacity_bytes=2**28, disk=disk)
    assert kvlib.make_cache(model, reuse=reader, prompt=prompt).get_seq_length() == 800
    (store,) = reader.stores.values()
    assert all(grows.count(id(pool)) == 1 for pool in store.pools) and len(grows) == len(store.pools)


def test_a_directory_removed_while_open_loses_no_write_silently_and_a_new_store_opens_a_new_tier(tmp_path: Path) -> None:
    import shutil

    import torch

    import kvlib
    from kvlib.transformers_compat import cache_argument
    from tests.adapters.conftest import PAD, build_model

    model = build_model("llama")
    prompts = [torch.randint(3, 90, (1, 40), generator=torch.Generator().manual_seed(seed)) for seed in (1, 2)]

    def generate(store: kvlib.PrefixStore, prompt: torch.Tensor) -> list[int]:
        cache = kvlib.make_cache(model, reuse=store, prompt=prompt)
        return model.generate(prompt, **cache_argument(cache), max_new_tokens=4, do_sample=False, pad_token_id=PAD)[0].tolist()

    expected = [model.generate(prompt, max_new_tokens=4, do_sample=False, pad_token_id=PAD)[0].tolist() for prompt in prompts]
    directory = tmp_path / "prefixes"
    first = kvlib.PrefixStore(model, capacity_bytes=2**24, disk=directory)
    assert generate(first, prompts[0]) == expected[0] and first.disk.writes == 2
    shutil.rmtree(directory)
    with pytest.warns(UserWarning, match="the directory was removed or its data.mdb replaced while open") as caught:
        assert generate(first, prompts[1]) == expected[1]
    assert len(caught) == 1 and first.disk.writes == 2 and first.disk.dropped == 2  # the second prompt's blocks: dropped, counted
    second = kvlib.PrefixStore(model, capacity_bytes=2**24, disk=directory)
    assert second.disk is not first.disk and second.disk.keys() == []  # a new environment, not the deleted one
    assert generate(second, prompts[1]) == expected[1] and second.disk.writes == 2 and len(second.disk.keys()) == 2

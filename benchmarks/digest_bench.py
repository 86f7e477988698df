"""Record checksum candidates at the disk tier's record sizes: MB/s of record bytes.

- ``record``: one prefix record of ``--record-kb`` KB (394 KB: a 16-token block of the ~100M
  Llama, every layer and KV head), checksummed whole, as ``decode_parts`` checks a record read
  (``in cache``: the same buffer again and again, as a record is digested right after it is
  copied out of the map) and over ``--spread-mb`` of distinct records (``from memory``).
- ``batch``: ``--batch`` spilled-page records of ``--row-kb`` KB (one head's fp16 page of 16
  tokens, header and token ids included), one checksum per row, as ``spilled_page_record.check_rows``
  checks a layer's spilled pages read in one transaction.

Candidates: XXH3-64 (``xxhash``), CRC32C in hardware through ``google-crc32c`` and through
``crc32c``. Medians of ``--repeats``; each timing loops for at least ``--min-seconds``.

The CRC32C candidates are not kvlib dependencies: ``pip install google-crc32c crc32c`` first.

Usage:

    python benchmarks/digest_bench.py [--record-kb 394] [--row-kb 4.3] [--batch 256] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np


def candidates() -> dict[str, Callable[[np.ndarray], int]]:
    import crc32c
    import google_crc32c
    import xxhash

    return {"xxh3_64 (xxhash)": xxhash.xxh3_64_intdigest, "crc32c (google-crc32c)": google_crc32c.value, "crc32c (crc32c)": crc32c.crc32c}


def rate(work: Callable[[], None], nbytes: int, repeats: int, min_seconds: float) -> float:
    """Median MB/s of ``work`` over ``nbytes`` bytes."""
    rates = []
    for _ in range(repeats):
        loops, start = 0, time.perf_counter()
        while True:
            work()
            loops += 1
            elapsed = time.perf_counter() - start
            if elapsed >= min_seconds:
                break
        rates.append(nbytes * loops / elapsed / 1e6)
    return statistics.median(rates)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--record-kb", type=float, default=394)
    parser.add_argument("--spread-mb", type=float, default=256)
    parser.add_argument("--row-kb", type=float, default=4.3)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--min-seconds", type=float, default=0.3)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    record_bytes = int(args.record_kb * 1000)
    one = rng.integers(0, 256, record_bytes, dtype=np.uint8)
    count = max(1, int(args.spread_mb * 1e6 // record_bytes))
    spread = [rng.integers(0, 256, record_bytes, dtype=np.uint8) for _ in range(count)]
    row_bytes = int(args.row_kb * 1000)
    rows = rng.integers(0, 256, (args.batch, row_bytes), dtype=np.uint8)
    row_views = list(rows)
    print(
        f"record {record_bytes} B (in cache; {count} distinct, {count * record_bytes / 1e6:.0f} MB, from memory); "
        f"batch of {args.batch} rows of {row_bytes} B"
    )
    for name, digest in candidates().items():
        in_cache = rate(lambda: digest(one), record_bytes, args.repeats, args.min_seconds)
        from_memory = rate(lambda: [digest(r) for r in spread], count * record_bytes, args.repeats, args.min_seconds)
        batch = rate(lambda: [digest(r) for r in row_views], args.batch * row_bytes, args.repeats, args.min_seconds)
        print(f"{name:24s} record in cache {in_cache:8.0f} MB/s   from memory {from_memory:8.0f} MB/s   batch {batch:8.0f} MB/s")


if __name__ == "__main__":
    main()

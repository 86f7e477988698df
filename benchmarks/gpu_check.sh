#!/usr/bin/env bash
# The GPU checks of a decode step (issue 34), as one prepared script for a lent GPU machine
# (the `device` tool; at most 7.8 minutes by its timeouts, under the 8-minute budget).
#
# Here, once (the GPU image has torch, triton, numba, xxhash; kvlib also needs transformers >= 5.18
# and lmdb, which travel as wheels in the ignored folder .whl):
#     benchmarks/gpu_check.sh --download
# On the device machine, from the repository root, with `.whl` carried:
#     benchmarks/gpu_check.sh            # CUDA tests, then the benchmarks into $OUT (or /tmp/gpu_out)
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "${1:-}" = "--download" ]; then
    grep -qx "/.whl/" .git/info/exclude 2>/dev/null || echo "/.whl/" >> .git/info/exclude
    for requirement in "transformers==5.24.0" "lmdb==3.0.0"; do
        python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
            --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
            --platform manylinux1_x86_64 -d .whl "$requirement"
    done
    ls -l .whl
    exit 0
fi

out="${OUT:-/tmp/gpu_out}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --target /tmp/site .  # kvlib itself
export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/device.txt"

# CUDA tests: the paged kernels (torch and Triton) against the CPU path, the store and the cache on
# the device, decode steps under set_sync_debug_mode("error") (no host sync), CUDA graphs captured
# by mode="reduce-overhead" giving the eager tokens (issue 45).
timeout 140 python3 -m pytest -q -p no:cacheprovider \
    tests/kernels/test_paged_attention_torch.py tests/kernels/test_paged_attention_triton.py \
    tests/storage/store/test_store_devices.py tests/adapters/cache/test_cache_devices.py \
    tests/adapters/cache/test_sync_free.py 2>&1 | tee "$out/cuda_tests.txt" | tail -5
timeout 70 python3 -m pytest -q -p no:cacheprovider tests/adapters/cache/test_compile.py -k cuda_graphs 2>&1 \
    | tee "$out/cuda_graph_tests.txt" | tail -5

# Decode speed against DynamicCache and StaticCache (Llama-3-8B shapes, bf16), the kernel against a copy.
timeout 150 python3 benchmarks/gpu_decode.py --out "$out" 2>&1 | tail -40

# Compiled decode against a compiled StaticCache, CUDA graphs (reduce-overhead), the ~100M Llama at 2k.
timeout 70 python3 benchmarks/bench_compiled_decode.py --device cuda --mode reduce-overhead --models llama100m \
    --contexts 2048 --caches exact,snapkv_int25 --new-tokens 32 --repeats 2 --out "$out" 2>&1 | tail -8

# Shared-prefix attention (Hydragen, issue 49) in the Engine's decode group, on and off step by step:
# K/V read per step and decode tok/s at 16 and 32 requests sharing a 2k- and a 4k-token prompt.
timeout 40 python3 benchmarks/shared_prefix_bench.py --device cuda --rows 16,32 --prompts 2048,4096 --steps 8 --new 2 \
    --out "$out" 2>&1 | tail -8

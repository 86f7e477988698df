"""keyformer_kernel: the fused CPU pass gives what the torch reference (gumbel_noise, then
gumbel_softmax) gives, over batches, grouped heads, padding rows and unseen slots."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlib.policies.eviction.keyformer import gumbel_noise, gumbel_softmax, noise_base
from kvlib.policies.eviction.keyformer_kernel import gumbel_softmax_rows


@settings(max_examples=60, deadline=None)
@given(
    batch=st.integers(1, 3),
    kv_heads=st.integers(1, 3),
    group=st.sampled_from([1, 3]),
    queries=st.integers(1, 6),
    slots=st.integers(1, 12),
    seed=st.integers(0, 2**63 - 1),
    layer=st.integers(0, 40),
    data=st.integers(0, 2**16),
)
def test_the_fused_pass_matches_the_torch_reference(batch, kv_heads, group, queries, slots, seed, layer, data):
    generator = torch.Generator().manual_seed(data)
    heads = kv_heads * group
    query_positions = torch.randint(0, 5000, (batch, queries), generator=generator)
    query_positions[0, 0] = -1  # a padding query: its weights row is all 0
    key_positions = torch.randint(0, 5000, (batch, kv_heads, slots), generator=generator)
    seen = torch.rand(batch, heads, queries, slots, generator=generator) < 0.7
    seen[0, :, 0] = False
    key_positions[..., 0] = -1  # an invalid slot: nobody sees it
    seen[..., 0] = False
    weights = torch.softmax(torch.randn(batch, heads, queries, slots, generator=generator) * 4, dim=-1) * seen
    tau = 1.0 + torch.rand(batch, queries, generator=generator)
    expected = gumbel_softmax(weights, gumbel_noise(seed, layer, query_positions, key_positions, heads), tau)
    got = np.empty(weights.shape, dtype=np.float32)
    gumbel_softmax_rows(
        weights.numpy(), query_positions.numpy(), key_positions.numpy(), tau.numpy(), np.uint64(noise_base(seed, layer)), got
    )
    torch.testing.assert_close(torch.from_numpy(got), expected, rtol=1e-5, atol=1e-7)
    assert torch.all(torch.from_numpy(got)[~seen] == 0)

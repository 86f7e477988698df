"""Choosing tokens and verifying drafts: greedy verification accepts the longest prefix equal to
the argmaxes plus one argmax; speculative sampling with a deterministic draft keeps the target
distribution (a chi-square test over many draws, fixed seed)."""

from __future__ import annotations

import torch

from kvlib.adapters.engine.sampling import next_token, target_probabilities, verify_draft


def chi_square_p(observed: torch.Tensor, expected_probabilities: torch.Tensor) -> float:
    """The p-value of Pearson's chi-square goodness-of-fit test (cells of expected mass > 0)."""
    expected = expected_probabilities * observed.sum()
    cells = expected > 0
    assert int(observed[~cells].sum()) == 0, "a draw fell where the target has no mass"
    statistic = ((observed[cells] - expected[cells]) ** 2 / expected[cells]).sum()
    freedom = int(cells.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(freedom / 2, dtype=torch.float64), statistic.double() / 2))


def test_greedy_verification_accepts_the_argmax_prefix_and_adds_one_token() -> None:
    logits = torch.full((4, 6), -1.0)
    for row, best in enumerate([3, 1, 4, 5]):
        logits[row, best] = 1.0
    assert verify_draft(logits, [3, 1, 4], do_sample=False) == [3, 1, 4, 5]  # all accepted, and the last row's token
    assert verify_draft(logits, [3, 2, 4], do_sample=False) == [3, 1]  # the first disagreement gives its argmax
    assert verify_draft(logits[:1], [], do_sample=False) == [next_token(logits[0], do_sample=False)]


def test_speculative_sampling_keeps_the_target_distribution() -> None:
    torch.manual_seed(0)
    logits = torch.randn(3, 6) * 1.5
    options = {"do_sample": True, "temperature": 0.8, "top_k": 5, "top_p": 0.95}
    targets = [target_probabilities(row, 0.8, 5, 0.95) for row in logits]
    draft = [int(targets[0].argmax()), int(targets[1].argmin())]  # a likely token, then one the top-k filter may drop
    generator = torch.Generator().manual_seed(3)
    first, second = torch.zeros(6), torch.zeros(6)
    draws = 6000
    for _ in range(draws):
        tokens = verify_draft(logits, draft, generator=generator, **options)
        first[tokens[0]] += 1
        if tokens[0] == draft[0]:  # given the first draft token, the second output token follows row 1's target
            second[tokens[1]] += 1
    assert chi_square_p(first, targets[0]) > 1e-3
    assert chi_square_p(second, targets[1]) > 1e-3
    assert 0 < second.sum() < draws

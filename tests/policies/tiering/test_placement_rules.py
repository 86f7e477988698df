"""Each tiering policy supplies its placement rule (the order pages leave a tier) and page
retrieval policies declare the retrieval interface."""

from __future__ import annotations

import pytest
import torch

import kvlib
from kvlib.placement import PageStats, least_recently_written, lowest_score_first
from kvlib.policies.tiering.lru import LRUPlacement
from kvlib.policies.tiering.quest import Quest
from kvlib.policies.tiering.random_pages import RandomPages
from kvlib.policies.tiering.score_aware import ScoreAwarePlacement
from kvlib.policy import PageRetrieval, Tiering

SCORED = PageStats(
    ids=torch.tensor([4, 9, 2, 7]), last_write=torch.tensor([3, 1, 3, 2]), score=torch.tensor([1.0, 5.0, 1.0, float("inf")]), tier="device"
)


def test_the_built_in_rules() -> None:
    assert least_recently_written(SCORED).tolist() == [1, 3, 0, 2]  # clock 1, 2, then the tie in candidate order
    assert lowest_score_first(SCORED).tolist() == [0, 2, 1, 3]  # scores 1, 1 (clock 3 both), 5, then unranked
    host = PageStats(SCORED.ids, SCORED.last_write, SCORED.score, "host")
    assert lowest_score_first(host).tolist() == least_recently_written(host).tolist()  # scores rank the device only


@pytest.mark.parametrize(
    "policy, rule",
    [
        (LRUPlacement(), least_recently_written),
        (ScoreAwarePlacement(), lowest_score_first),
        (Quest(placement=LRUPlacement()), least_recently_written),
        (Quest(placement=ScoreAwarePlacement()), lowest_score_first),
        (RandomPages(placement=LRUPlacement()), least_recently_written),
        (Quest(), lowest_score_first),
    ],
)
def test_each_policy_supplies_its_rule(policy: Tiering, rule) -> None:
    for tier in ("device", "host"):
        stats = PageStats(SCORED.ids, SCORED.last_write, SCORED.score, tier)
        assert policy.leaving_order(stats).tolist() == rule(stats).tolist()


def test_page_retrieval_is_declared() -> None:
    assert isinstance(Quest(), PageRetrieval) and isinstance(RandomPages(), PageRetrieval)
    assert Quest.retrieves_pages and Quest.key_summaries and not LRUPlacement.retrieves_pages
    assert not isinstance(kvlib.parse_policy("score_aware"), PageRetrieval)
    assert PageRetrieval.__abstractmethods__ == {"sparse", "select_pages"}
    with pytest.raises(ValueError, match="must be a device/host placement"):
        Quest(placement=Quest())


@pytest.mark.parametrize(
    "spec, message",
    [
        ("lru(device_mb=1e308)", r"device_mb=1e\+308 MiB is more than the memory of this machine's largest device holds"),
        ("lru(host_mb=1e300)", "host_mb=1e\\+300 MiB is more than this host's memory holds"),
        (
            "lru(host_mb=1, disk='/tmp/kvlib-nowhere/x', disk_mb=1e15)",
            "disk_mb=1e\\+15 MiB is more than the file system holding '/tmp/kvlib-nowhere/x' holds",
        ),
    ],
)
def test_tier_budgets_are_checked_against_what_the_machine_holds(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        kvlib.parse_spec(spec)
    assert kvlib.parse_spec("lru(device_mb=512, host_mb=1024, disk='/tmp/kvlib-nowhere', disk_mb=2048)").tiering.disk_mb == 2048

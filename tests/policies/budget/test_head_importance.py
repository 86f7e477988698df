"""head_importance: a floor per head plus an importance share of the whole model's budget, from a
profile that ``calibrate`` measures once and saves as JSON."""

from __future__ import annotations

import json
import math
import os
from fractions import Fraction
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kvlib
from kvlib.default_model import ByteTokenizer
from kvlib.limits import MAX_PROFILE_BYTES
from kvlib.model_shape import kv_shape
from kvlib.policies.budget.head_importance import PROFILE_FORMAT, HeadImportance, calibrate, load_profile
from tests.adapters.conftest import build_model, left_padded
from tests.policies.budget.conftest import check_memory, kept_counts, make_request, run, run_alone

STORY = (
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the park with her dog"
    " Max. One day, Lily found a big red ball under a tree. She wanted to share it with her friend Tom, so she"
    " ran to his house. Tom was happy to see the ball and they played all day."
)


def write_profile(path, weights, **fields) -> str:
    """Save a profile JSON with ``weights`` (and any other fields, which override the defaults)."""
    data = {"format": PROFILE_FORMAT, "weights": weights, **fields}
    path.write_text(json.dumps(data))
    return str(path)


@pytest.fixture(scope="module")
def profiles(tmp_path_factory):
    return tmp_path_factory.mktemp("profiles")


def exact_caps(weights: list[list[float]], budget: int, floor: float) -> tuple[int, list[list[Fraction]]]:
    """HeadKV by hand: every head's floor ``floor(floor * B)``, and its exact share of the pool left
    of the model's ``layers * heads * B`` tokens, in proportion to its weight."""
    layers, heads = len(weights), len(weights[0])
    base = math.floor(budget * floor)
    pool = layers * heads * (budget - base)
    whole = sum(Fraction(w) for row in weights for w in row)
    return base, [[pool * Fraction(w) / whole for w in row] for row in weights]


def reference_caps(weights: list[list[float]], budget: int, floor: float) -> list[list[int]]:
    """``exact_caps`` rounded by largest remainder (unambiguous ties only), ``[layers][heads]``."""
    base, shares = exact_caps(weights, budget, floor)
    flat = [share for row in shares for share in row]
    parts = [math.floor(share) for share in flat]
    leftover = int(sum(flat)) - sum(parts)  # the pool, an integer
    remainders = sorted((share - part for share, part in zip(flat, parts)), reverse=True)
    if leftover:
        assert remainders[leftover - 1] > remainders[leftover], "ambiguous rounding"
        parts = [part + int(share - part >= remainders[leftover - 1]) for share, part in zip(flat, parts)]
    heads = len(weights[0])
    return [[base + part for part in parts[i : i + heads]] for i in range(0, len(parts), heads)]


def all_caps(allocation: HeadImportance, tokens: list[int]) -> torch.Tensor:
    """int64 ``[layers, batch, heads]``: the caps of every layer for rows with budgets ``tokens``."""
    layers, heads = allocation.weights.shape
    counts = [[10**6] * heads for _ in tokens]
    return torch.stack([allocation.caps(make_request(layer, layers, tokens, counts)) for layer in range(layers)])


WEIGHT = st.one_of(st.just(0.0), st.integers(1, 4).map(float), st.floats(1e-3, 1e3))


@st.composite
def profiles_and_budgets(draw: st.DrawFn):
    layers, heads = draw(st.integers(1, 6)), draw(st.integers(1, 6))
    rows = draw(
        st.lists(st.lists(WEIGHT, min_size=heads, max_size=heads), min_size=layers, max_size=layers).filter(
            lambda rows: sum(map(sum, rows)) > 0
        )
    )
    tokens = draw(st.lists(st.integers(0, 300), min_size=1, max_size=3))
    floor = draw(st.one_of(st.sampled_from([0.0, 0.2, 1.0]), st.floats(0.0, 1.0)))
    return rows, tokens, floor


@settings(max_examples=100, deadline=None)
@given(profiles_and_budgets())
def test_caps_are_the_floor_plus_an_importance_share_of_the_model_budget(profiles, problem):
    rows, tokens, floor = problem
    allocation = HeadImportance(profile=write_profile(profiles / "random.json", rows), floor=floor)
    layers, heads = len(rows), len(rows[0])
    caps = all_caps(allocation, tokens)
    assert caps.dtype == torch.int64 and caps.shape == (layers, len(tokens), heads)
    for row, budget in enumerate(tokens):
        base, shares = exact_caps(rows, budget, floor)
        got = caps[:, row]
        assert int(got.sum()) == layers * heads * budget  # the model's budget, exactly
        remainders = {"raised": [], "kept down": []}
        for layer in range(layers):
            for head in range(heads):
                share, part = shares[layer][head], int(got[layer, head]) - base
                assert math.floor(share) <= part <= math.ceil(share), (layer, head, part, share)
                if rows[layer][head] == 0:
                    assert part == 0  # an unimportant head keeps just its floor
                if part != share:
                    remainders["raised" if part > share else "kept down"].append(share - math.floor(share))
        if remainders["raised"] and remainders["kept down"]:  # largest remainders first (within float error)
            assert min(remainders["raised"]) >= max(remainders["kept down"]) - 1e-9
    for layer in range(layers):
        request = make_request(layer, layers, tokens, [[0] * heads for _ in tokens])
        assert torch.equal(allocation.layer_tokens(request), caps[layer].sum(-1))


def test_worked_example(profiles):
    path = write_profile(profiles / "two.json", [[1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 3.0]])
    # B = 8, floor 0.25: every head 2, and the pool of 8 heads x 6 tokens = 48 goes 1 : 3
    assert all_caps(HeadImportance(profile=path, floor=0.25), [8])[:, 0].tolist() == [[14, 2, 2, 2], [2, 2, 2, 38]]
    assert reference_caps([[1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 3.0]], 8, 0.25) == [[14, 2, 2, 2], [2, 2, 2, 38]]
    # floor 1: every head keeps B, whatever the weights
    assert (all_caps(HeadImportance(profile=path, floor=1.0), [5, 0]) == torch.tensor([5, 0]).view(1, 2, 1)).all()


def test_weights_near_the_float_maximum_still_share_the_model_budget_exactly(profiles):
    # every weight is finite, so the profile is valid; only their float sum overflows
    path = write_profile(profiles / "huge.json", [[1e308, 1e308], [1e308, 0.0]])
    caps = all_caps(HeadImportance(profile=path, floor=0.0), [6])[:, 0]
    assert caps.tolist() == [[8, 8], [8, 0]]


def test_a_profile_for_another_model_is_refused_at_the_caps(profiles):
    allocation = HeadImportance(profile=write_profile(profiles / "small.json", [[1.0, 2.0]] * 3))
    with pytest.raises(ValueError, match=r"is for 3 layers x 2 KV heads, but the model has 5 x 4: calibrate"):
        allocation.caps(make_request(0, 5, [8], [[9] * 4]))
    with pytest.raises(ValueError, match=r"is for 3 layers x 2 KV heads, but the model has 3 x 3"):
        allocation.caps(make_request(0, 3, [8], [[9] * 3]))


# -- profiles: what load_profile accepts and the errors it gives -----------------------------------


@pytest.mark.parametrize(
    "text, problem",
    [
        ("{not json", "cannot read head_importance profile"),
        ("[1, 2]", "is not a head_importance profile"),
        (json.dumps({"format": "kvlib.head_importance/2", "weights": [[1.0]]}), "is not a head_importance profile"),
        (json.dumps({"weights": [[1.0]]}), "is not a head_importance profile"),
        (json.dumps({"format": PROFILE_FORMAT}), "weights must be a non-empty"),
        (json.dumps({"format": PROFILE_FORMAT, "weights": []}), "weights must be a non-empty"),
        (json.dumps({"format": PROFILE_FORMAT, "weights": [[]]}), "weights must be a non-empty"),
        (json.dumps({"format": PROFILE_FORMAT, "weights": [1.0, 2.0]}), "weights must be a non-empty"),
        (json.dumps({"format": PROFILE_FORMAT, "weights": [[1.0, 2.0], [3.0]]}), "weights must be a non-empty"),
        (json.dumps({"format": PROFILE_FORMAT, "weights": [[1.0, -0.5]]}), "weights must be finite numbers >= 0"),
        (f'{{"format": "{PROFILE_FORMAT}", "weights": [[1.0, NaN]]}}', "weights must be finite numbers >= 0"),
        (f'{{"format": "{PROFILE_FORMAT}", "weights": [[Infinity, 1.0]]}}', "weights must be finite numbers >= 0"),
        (json.dumps({"format": PROFILE_FORMAT, "weights": [["1.0", 2.0]]}), "weights must be finite numbers >= 0"),
        (json.dumps({"format": PROFILE_FORMAT, "weights": [[True, 2.0]]}), "weights must be finite numbers >= 0"),
        (json.dumps({"format": PROFILE_FORMAT, "weights": [[None, 2.0]]}), "weights must be finite numbers >= 0"),
        (json.dumps({"format": PROFILE_FORMAT, "weights": [[10**400, 1]]}), "weights must be finite numbers >= 0"),
        (json.dumps({"format": PROFILE_FORMAT, "weights": [[0, 0.0], [0.0, 0]]}), "weights sum to 0"),
    ],
    ids=[
        "not-json",
        "not-an-object",
        "other-format",
        "no-format",
        "no-weights",
        "empty",
        "empty-rows",
        "flat",
        "ragged",
        "negative",
        "nan",
        "infinity",
        "string",
        "bool",
        "null",
        "huge-int",
        "all-zero",
    ],
)
def test_malformed_profiles_raise_value_error_naming_the_problem(tmp_path, text, problem):
    path = tmp_path / "profile.json"
    path.write_text(text)
    for load in (load_profile, lambda p: HeadImportance(profile=p)):
        with pytest.raises(ValueError, match=problem) as error:
            load(str(path))
        assert str(path) in str(error.value)


def test_a_missing_profile_raises_value_error(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a short name: error messages cut what they repeat at 80 characters
    missing = "missing.json"
    with pytest.raises(ValueError, match="cannot read head_importance profile") as error:
        load_profile(missing)
    assert missing in str(error.value)
    with pytest.raises(ValueError, match="cannot read head_importance profile"):
        kvlib.parse_spec(f"tova+head_importance(profile={missing!r})")


def test_a_profile_that_is_no_regular_file_or_too_big_is_refused_before_it_is_read(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # short names: error messages cut what they repeat at 80 characters
    fifo = Path("pipe.json")
    os.mkfifo(fifo)  # no writer: a plain read would block for ever
    nested = Path("nested.json")
    nested.write_text("[" * 100_000 + "]" * 100_000)
    big = Path("big.json")
    with open(big, "wb") as handle:
        handle.truncate(MAX_PROFILE_BYTES + 1)
    folder = Path("folder")
    folder.mkdir()
    for path, problem in (("/dev/zero", "is not a regular file"), (fifo, "is not a regular file"), (folder, "is not a regular file")):
        with pytest.raises(ValueError, match=f"head_importance profile '{path}' {problem}"):
            load_profile(str(path))
    with pytest.raises(ValueError, match=f"holds more than {MAX_PROFILE_BYTES} bytes"):
        load_profile(str(big))
    with pytest.raises(ValueError, match=f"cannot read head_importance profile '{nested}'"):
        load_profile(str(nested))


def test_a_valid_profile_loads_as_float64_layers_by_heads(tmp_path):
    path = write_profile(tmp_path / "p.json", [[1, 2.5, 0], [0.25, 0, 7]], window=32, note="extra fields are fine")
    weights = load_profile(path)
    assert weights.dtype == torch.float64 and weights.tolist() == [[1.0, 2.5, 0.0], [0.25, 0.0, 7.0]]


def test_parameters_and_spec_round_trip(tmp_path):
    path = write_profile(tmp_path / "p.json", [[1.0, 2.0]])
    assert kvlib.get_policy("head_importance") is HeadImportance and not HeadImportance.needs_scores
    text = f"tova+head_importance(profile={path!r}, floor=0.5)"
    spec = kvlib.parse_spec(text)
    assert spec.budget.profile == path and spec.budget.floor == 0.5
    assert str(spec) == text and kvlib.parse_spec(str(spec)) == spec
    assert HeadImportance(profile=path).spec() == f"head_importance(profile={path!r})"
    assert spec.budget.weights.tolist() == [[1.0, 2.0]]
    with pytest.raises(ValueError, match="profile"):
        kvlib.parse_spec("tova+head_importance")
    for bad in ("-0.5", "2.0"):
        with pytest.raises(ValueError, match="floor must be in"):
            kvlib.parse_spec(f"tova+head_importance(profile={path!r}, floor={bad})")


# -- calibrate ------------------------------------------------------------------------------------


def story_ids() -> torch.Tensor:
    """The story above as the default model's byte ids ``[1, tokens]`` (BOS first)."""
    return torch.tensor([ByteTokenizer().encode(STORY, bos=True)])


def distant_mass_by_hand(model, ids: torch.Tensor, window: int, sinks: int) -> torch.Tensor:
    """Each KV head's mean attention on keys ``sinks <= p < t - window`` from queries ``t >= sinks +
    window`` (over the query heads of its group), plus 1e-3, by explicit loops over eager attention."""
    previous = model.config._attn_implementation
    model.set_attn_implementation("eager")
    with torch.no_grad():
        attentions = model(ids, output_attentions=True).attentions
    model.set_attn_implementation(previous)
    kv_heads = kv_shape(model).num_kv_heads
    rows = []
    for weights in attentions:  # [batch, query_heads, queries, keys]
        group = weights.shape[1] // kv_heads
        row = []
        for kv_head in range(kv_heads):
            masses = [
                float(weights[b, q, t, sinks : t - window].sum())
                for b in range(weights.shape[0])
                for q in range(kv_head * group, (kv_head + 1) * group)
                for t in range(sinks + window, weights.shape[2])
            ]
            row.append(sum(masses) / len(masses) + 1e-3)
        rows.append(row)
    return torch.tensor(rows, dtype=torch.float64)


def test_calibrate_writes_the_distant_attention_mass_of_each_head(tmp_path):
    model = build_model("default")
    ids = story_ids()
    assert ids.shape[1] > 40
    path = tmp_path / "default.json"
    weights = calibrate(model, ids, path, window=16, sinks=2)
    assert weights.dtype == torch.float64 and weights.shape == (model.config.num_hidden_layers, model.config.num_key_value_heads)
    assert torch.allclose(weights, distant_mass_by_hand(model, ids, window=16, sinks=2), rtol=1e-5, atol=1e-6)
    assert (weights >= 1e-3).all() and weights.std() > 0.01  # a trained model's heads differ
    assert torch.equal(load_profile(str(path)), weights)
    saved = json.loads(path.read_text())
    assert saved["format"] == PROFILE_FORMAT and (saved["window"], saved["sinks"]) == (16, 2)
    assert saved["calibration_tokens"] == ids.shape[1]
    assert model.config._attn_implementation == "sdpa"


def test_calibrate_a_batch_of_a_mha_model_and_restore_a_kvlib_attention(tmp_path):
    model = build_model("gpt2")
    kvlib.attach(model)
    ids, _ = left_padded([20, 20], seed=8)
    weights = calibrate(model, ids, tmp_path / "gpt2.json", window=4, sinks=1)
    assert weights.shape == (2, 4)
    assert torch.allclose(weights, distant_mass_by_hand(model, ids, window=4, sinks=1), rtol=1e-5, atol=1e-6)
    assert model.config._attn_implementation == "kvlib_sdpa"


def test_calibrate_restores_the_attention_when_the_forward_fails(tmp_path):
    model = build_model("gpt2")

    def broken(*args, **kwargs):
        raise RuntimeError("out of memory, say")

    model.forward = broken
    with pytest.raises(RuntimeError, match="out of memory"):
        calibrate(model, torch.ones(1, 40, dtype=torch.long), tmp_path / "never.json")
    assert model.config._attn_implementation == "sdpa" and not (tmp_path / "never.json").exists()


@pytest.mark.parametrize("shape", [(1, 36), (1, 10), (40,)])
def test_calibrate_refuses_too_few_tokens(tmp_path, shape):
    model = build_model("gpt2")
    with pytest.raises(ValueError, match=r"needs input_ids \[batch, tokens\] with tokens > sinks \+ window = 36"):
        calibrate(model, torch.ones(shape, dtype=torch.long), tmp_path / "never.json")
    assert model.config._attn_implementation == "sdpa"


# -- through generate -------------------------------------------------------------------------------


def test_through_generate_each_head_keeps_its_calibrated_share(tmp_path):
    model = build_model("default")
    path = str(tmp_path / "default.json")
    weights = calibrate(model, story_ids(), path, window=16, sinks=2)
    budget, floor, lengths, new_tokens = 8, 0.25, [44, 52], 3
    spec = f"knorm+head_importance(profile={path!r}, floor={floor})"
    cache, ids = run(model, spec, budget, lengths, seed=9, new_tokens=new_tokens)
    expected = torch.tensor(reference_caps(weights.tolist(), budget, floor))  # [layers, heads]
    held = [length + new_tokens - 1 for length in lengths]
    assert int(expected.max()) <= min(held) and int(expected.min()) < int(expected.max())
    counts = kept_counts(cache)  # [layers, batch, heads]
    for row in range(len(lengths)):
        assert torch.equal(counts[:, row], expected)
        assert int(counts[:, row].sum()) == model.config.num_hidden_layers * model.config.num_key_value_heads * budget
    check_memory(cache, counts)
    alone = kept_counts(run_alone(model, spec, budget, ids, 0, lengths[0], new_tokens=new_tokens))
    assert torch.equal(counts[:, 0], alone[:, 0])


def test_through_generate_caps_over_the_held_tokens_keep_them_all(tmp_path):
    model = build_model("gpt2")  # 2 layers x 4 heads
    path = write_profile(tmp_path / "gpt2.json", [[1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 3.0]])
    lengths, new_tokens = [20, 30], 3
    cache, _ = run(model, f"tova+head_importance(profile={path!r}, floor=0.25)", 8, lengths, seed=10, new_tokens=new_tokens)
    caps = torch.tensor([[14, 2, 2, 2], [2, 2, 2, 38]])
    counts = kept_counts(cache)
    for row, length in enumerate(lengths):
        assert torch.equal(counts[:, row], caps.clamp(max=length + new_tokens - 1))
    check_memory(cache, counts)


def test_a_profile_for_another_model_is_refused_before_the_model_runs(tmp_path):
    model = build_model("gpt2")  # 2 layers x 4 heads
    path = write_profile(tmp_path / "default.json", [[1.0] * 4] * 5)
    with pytest.raises(ValueError, match=r"is for 5 layers x 4 KV heads, but the model has 2 x 4: calibrate a profile"):
        kvlib.make_cache(model, f"knorm+head_importance(profile={path!r})", budget=4)

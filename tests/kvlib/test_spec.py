"""Tests for kvlib.spec: parsing spec strings / objects into a validated Spec, and back."""

import contextlib
import dataclasses
import re
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import kvlib
from kvlib import registry
from kvlib.errors import SpecError
from kvlib.policies.eviction.streaming_llm import StreamingLLM
from kvlib.policy import Budget, Eviction, Reuse, Tiering
from kvlib.spec import Spec, parse_spec
from kvlib.spec_text import parameters_help, parse_policy

# -- test-only policies (registered only inside `extra_policies`) -----------------------


@dataclass
class MyTestEvict(Eviction):
    """Test-only eviction: keeps everything equally."""

    def score(self, view):
        return torch.zeros(view.valid.shape)


@dataclass
class MyTestWrap(Eviction):
    """Test-only wrapper eviction taking another eviction policy inside."""

    inner: Eviction | None = None
    scale: float = 1.0

    def score(self, view):
        return self.inner.score(view) * self.scale


@dataclass
class MyTestReuseA(Reuse):
    """Test-only reuse policy A."""

    share: bool = True


@dataclass
class MyTestReuseB(Reuse):
    """Test-only reuse policy B."""

    mode: str = "prefix"


@dataclass
class MyTestBudget(Budget):
    """Test-only budget with a float and a tuple parameter."""

    ratio: float = 0.5
    layers: tuple[int, ...] = ()

    def caps(self, request):
        return request.tokens.unsqueeze(-1).expand_as(request.counts)


@dataclass
class MyTestTier(Tiering):
    """Test-only tiering policy."""

    host_pages: int = 0


@dataclass
class MyTestUnregistered(Eviction):
    """Never registered."""

    def score(self, view):
        return torch.zeros(view.valid.shape)


EXTRA = {
    "mytest_evict": MyTestEvict,
    "mytest_wrap": MyTestWrap,
    "mytest_reuse_a": MyTestReuseA,
    "mytest_reuse_b": MyTestReuseB,
    "mytest_budget": MyTestBudget,
    "mytest_tier": MyTestTier,
}


@contextlib.contextmanager
def temporary_registry():
    """Register the test-only policies in a copy of the registry; restore the original after."""
    registry.available_policies()  # built-ins into the real registry first
    original = registry._registry
    registry._registry = dict(original)
    try:
        for name, cls in EXTRA.items():
            registry.register(name)(cls)
        yield registry._registry
    finally:
        registry._registry = original


@pytest.fixture
def extra_policies():
    with temporary_registry() as reg:
        yield reg


def test_temporary_registry_restores_the_registry():
    with temporary_registry():
        assert "mytest_evict" in registry.available_policies()["eviction"]
    assert "mytest_evict" not in registry.available_policies()["eviction"]
    with pytest.raises(SpecError):
        parse_spec("mytest_evict")


# -- what parses ------------------------------------------------------------------------------


@pytest.mark.parametrize("empty", [None, "", "full", "   ", " full ", [], ()])
def test_empty_specs(empty):
    spec = parse_spec(empty)
    assert spec == Spec()
    assert spec.policies() == []
    assert str(spec) == "full"


def test_name_only_uses_defaults():
    spec = parse_spec("streaming_llm")
    assert spec.eviction == StreamingLLM()
    assert spec.eviction.sinks == 4
    assert spec.policies() == [StreamingLLM()]
    assert str(spec) == "streaming_llm"


@pytest.mark.parametrize("text", ["streaming_llm(sinks=2)", "  streaming_llm( sinks = 2 )  ", "streaming_llm(sinks=0x2)"])
def test_name_with_parameters(text):
    spec = parse_spec(text)
    assert isinstance(spec.eviction, StreamingLLM)
    assert spec.eviction.sinks == 2
    assert (spec.budget, spec.quantization, spec.lowrank, spec.reuse, spec.tiering) == (None, None, None, (), None)
    assert str(spec) == "streaming_llm(sinks=2)"


def test_policy_object():
    obj = StreamingLLM(sinks=1)
    spec = parse_spec(obj)
    assert spec.eviction is obj
    assert str(spec) == "streaming_llm(sinks=1)"


def test_list_mixing_strings_and_objects(extra_policies):
    tier = MyTestTier(host_pages=8)
    spec = parse_spec(["streaming_llm(sinks=3)", tier, "mytest_reuse_a+mytest_budget(ratio=0.25)"])
    assert spec.eviction == StreamingLLM(sinks=3)
    assert spec.tiering is tier
    assert spec.reuse == (MyTestReuseA(),)
    assert spec.budget == MyTestBudget(ratio=0.25)


def test_spec_passes_through():
    spec = parse_spec("streaming_llm(sinks=2)")
    assert parse_spec(spec) is spec


def test_canonical_order_is_by_kind(extra_policies):
    spec = parse_spec("mytest_tier(host_pages=1)+mytest_reuse_b+mytest_budget+streaming_llm(sinks=0)")
    assert str(spec) == "streaming_llm(sinks=0)+mytest_budget+mytest_reuse_b+mytest_tier(host_pages=1)"
    assert [s.kind for s in spec.policies()] == ["eviction", "budget", "reuse", "tiering"]


@pytest.mark.parametrize(
    "text",
    [
        "streaming_llm",
        "streaming_llm(sinks=0)",
        "mytest_budget(ratio=1e-05, layers=(0, 3))+mytest_reuse_a(share=False)+mytest_reuse_b(mode='x y')",
        "mytest_wrap(inner='streaming_llm(sinks=1)', scale=2.5)+mytest_tier(host_pages=4)",
        "mytest_reuse_b(mode='it\\'s')",
    ],
)
def test_str_round_trips(extra_policies, text):
    spec = parse_spec(text)
    canonical = str(spec)
    again = parse_spec(canonical)
    assert again == spec
    assert str(again) == canonical


@given(sinks=st.integers(min_value=0, max_value=2**63 - 1))
def test_sinks_round_trip_property(sinks):
    spec = parse_spec(f"streaming_llm(sinks={sinks})")
    assert spec.eviction.sinks == sinks
    canonical = str(spec)
    assert canonical == ("streaming_llm" if sinks == 4 else f"streaming_llm(sinks={sinks})")
    assert parse_spec(canonical) == spec
    assert parse_spec(StreamingLLM(sinks=sinks)) == spec


@given(
    ratio=st.floats(allow_nan=False, allow_infinity=False),
    layers=st.lists(st.integers(min_value=-(2**40), max_value=2**40), max_size=5),
    mode=st.text(max_size=10),
)
def test_round_trip_property_for_floats_tuples_and_strings(ratio, layers, mode):
    with temporary_registry():
        spec = parse_spec([MyTestBudget(ratio=ratio, layers=layers), MyTestReuseB(mode=mode)])
        assert spec.budget.layers == tuple(layers)
        again = parse_spec(str(spec))
        assert again == spec


def test_reuse_admits_several(extra_policies):
    spec = parse_spec("mytest_reuse_a+mytest_reuse_b(mode='suffix')")
    assert spec.reuse == (MyTestReuseA(), MyTestReuseB(mode="suffix"))
    assert str(spec) == "mytest_reuse_a+mytest_reuse_b(mode='suffix')"
    assert parse_spec(str(spec)) == spec


def test_nested_policy_from_spec_string(extra_policies):
    spec = parse_spec('mytest_wrap(inner="streaming_llm(sinks=1)")')
    assert isinstance(spec.eviction, MyTestWrap)
    assert spec.eviction.inner == StreamingLLM(sinks=1)
    assert str(spec) == "mytest_wrap(inner='streaming_llm(sinks=1)')"
    assert parse_spec(str(spec)) == spec


def test_nested_policy_object_and_default_none(extra_policies):
    inner = StreamingLLM(sinks=0)
    assert MyTestWrap(inner=inner).inner is inner
    assert parse_spec("mytest_wrap").eviction.inner is None
    assert parse_spec(MyTestWrap(inner="streaming_llm")).eviction.inner == StreamingLLM()
    assert str(parse_spec(MyTestWrap(inner=inner))) == "mytest_wrap(inner='streaming_llm(sinks=0)')"


@pytest.mark.parametrize(
    "inner, problem",
    [
        ("'mytest_budget'", "inner"),  # wrong kind
        ("'nope_not_a_policy'", "inner"),  # unknown name
        ("'streaming_llm+mytest_evict'", "inner"),  # more than one
        ("3", "inner"),
    ],
)
def test_nested_policy_errors(extra_policies, inner, problem):
    with pytest.raises(SpecError, match=problem) as info:
        parse_spec(f"mytest_wrap(inner={inner})")
    assert "Eviction | None" in str(info.value)


# -- errors -----------------------------------------------------------------------------------


def test_unknown_name():
    with pytest.raises(SpecError) as info:
        parse_spec("streaming_lm(sinks=2)")
    message = str(info.value)
    assert "unknown policy 'streaming_lm'" in message
    assert "'streaming_llm'" in message
    assert re.search(r"eviction: [a-z0-9_, ]*streaming_llm", message)


def test_unknown_name_in_a_composition():
    with pytest.raises(SpecError, match="unknown policy 'full'"):
        parse_spec("streaming_llm+full")


def test_unknown_parameter_lists_valid_parameters():
    with pytest.raises(SpecError) as info:
        parse_spec("streaming_llm(sink=2)")
    message = str(info.value)
    assert "streaming_llm has no parameter 'sink'" in message
    assert "valid: sinks (int, default 4)" in message


def test_unknown_parameter_lists_every_parameter(extra_policies):
    with pytest.raises(SpecError) as info:
        parse_spec("mytest_budget(ratio=0.1, bits=2, layers=(1,))")
    message = str(info.value)
    assert "'bits'" in message
    assert "ratio (float, default 0.5)" in message
    assert "layers (tuple[int, ...], default ())" in message


@pytest.mark.parametrize("value", ["'4'", "2.5", "True", "None", "(1, 2)", "[4]", "1j"])
def test_ill_typed_parameter(value):
    with pytest.raises(SpecError) as info:
        parse_spec(f"streaming_llm(sinks={value})")
    message = str(info.value)
    assert "streaming_llm" in message
    assert "'sinks'" in message
    assert "must be int" in message


@pytest.mark.parametrize("kwargs", [{"sinks": "4"}, {"sinks": 2.5}, {"sinks": True}])
def test_ill_typed_parameter_in_constructor(kwargs):
    with pytest.raises(SpecError, match="parameter 'sinks' must be int"):
        StreamingLLM(**kwargs)


@pytest.mark.parametrize("text", ["streaming_llm(2)", "streaming_llm(2, sinks=3)"])
def test_positional_argument(text):
    with pytest.raises(SpecError, match=r"parameters must be named, as in streaming_llm\(param=value\)"):
        parse_spec(text)


def test_double_star_kwargs():
    with pytest.raises(SpecError, match=r"'\*\*' is not allowed"):
        parse_spec("streaming_llm(**{'sinks': 2})")


@pytest.mark.parametrize(
    "value",
    ["foo", "__import__('os')", "len('ab')", "1 if True else 2", "os.sep", "[x for x in (1,)]", "lambda: 1"],
)
def test_non_literal_value(value):
    with pytest.raises(SpecError) as info:
        parse_spec(f"streaming_llm(sinks={value})")
    message = str(info.value)
    assert "value of 'sinks' must be a literal" in message


def test_non_literal_value_is_not_executed(tmp_path):
    target = tmp_path / "pwned"
    for value in (f"open({str(target)!r}, 'w')", f"__import__('pathlib').Path({str(target)!r}).touch()"):
        with pytest.raises(SpecError, match="must be a literal"):
            parse_spec(f"streaming_llm(sinks={value})")
    assert not target.exists()


@pytest.mark.parametrize(
    "text",
    ["os.system('true')", "streaming_llm(sinks=1)(x=2)", "streaming_llm - 1", "[streaming_llm]", "'streaming_llm'", "3"],
)
def test_terms_that_are_not_names_or_calls(text):
    with pytest.raises(SpecError, match="expected name or name\\(param=value\\)"):
        parse_spec(text)


@pytest.mark.parametrize("text", ["streaming_llm(", "streaming_llm(sinks=)", "+", "streaming_llm++", "streaming llm", "a=1"])
def test_syntax_error(text):
    with pytest.raises(SpecError) as info:
        parse_spec(text)
    message = str(info.value)
    assert f"cannot parse spec {text!r}" in message
    assert "name(param=value)" in message


def test_two_evictions_rejected(extra_policies):
    with pytest.raises(SpecError) as info:
        parse_spec("streaming_llm+mytest_evict")
    message = str(info.value)
    assert "at most 1 eviction policy" in message
    assert "streaming_llm and mytest_evict" in message


@pytest.mark.parametrize(
    "spec",
    [
        "streaming_llm+streaming_llm(sinks=1)",
        ["streaming_llm", StreamingLLM(sinks=1)],
        [MyTestBudget(), "mytest_budget"],
        ["mytest_tier", MyTestTier(host_pages=1)],
    ],
)
def test_two_of_a_single_kind_rejected(extra_policies, spec):
    with pytest.raises(SpecError, match="a spec admits at most 1"):
        parse_spec(spec)


def test_unregistered_policy_instance():
    with pytest.raises(SpecError) as info:
        parse_spec(MyTestUnregistered())
    assert "MyTestUnregistered is not registered" in str(info.value)
    assert "kvlib.register" in str(info.value)
    with pytest.raises(SpecError, match="not registered"):
        parse_spec(["streaming_llm", MyTestUnregistered()])


@dataclass
class UnregisteredStreamingSubclass(StreamingLLM):
    """A subclass of a registered policy, itself never registered."""

    def score(self, view):
        return -super().score(view)


def test_unregistered_subclass_of_registered_policy():
    with pytest.raises(SpecError, match="not registered"):
        parse_spec(UnregisteredStreamingSubclass(sinks=1))


@pytest.mark.parametrize("bad", [42, 1.5, [42], [None], [Spec()], {"streaming_llm": {}}])
def test_not_a_spec(bad):
    with pytest.raises(SpecError, match="spec"):
        parse_spec(bad)


@pytest.mark.parametrize("text", ["streaming_llm(sinks=-1)", "streaming_llm(sinks=-100)"])
def test_value_out_of_range(text):
    with pytest.raises(SpecError) as info:
        parse_spec(text)
    assert "sinks must be >= 0" in str(info.value)
    assert str(info.value).startswith("streaming_llm: ")


def test_spec_errors_are_value_errors():
    assert issubclass(SpecError, ValueError)
    with pytest.raises(ValueError):
        parse_spec("nope")


@pytest.mark.parametrize("value", ["{[]: 1}", "{[1]}"])
def test_unhashable_literal_is_a_spec_error(value):
    with pytest.raises(SpecError):
        parse_spec(f"streaming_llm(sinks={value})")


def test_repeated_parameter_is_rejected():
    with pytest.raises(SpecError, match="sinks"):
        parse_spec("streaming_llm(sinks=1, sinks=2)")


@pytest.mark.parametrize("ratio", [float("inf"), float("-inf"), float("nan")])
def test_non_finite_float_is_rejected(extra_policies, ratio):
    """Non-finite floats could not round-trip through a spec string, so they are refused."""
    with pytest.raises(SpecError, match="finite"):
        MyTestBudget(ratio=ratio)


# -- parse_policy ---------------------------------------------------------------------------


def test_parse_policy_one():
    policy = parse_policy("streaming_llm(sinks=3)")
    assert policy == StreamingLLM(sinks=3)
    assert policy.spec() == "streaming_llm(sinks=3)"


@pytest.mark.parametrize("text, count", [("", 0), ("full", 0), ("streaming_llm+streaming_llm", 2)])
def test_parse_policy_needs_exactly_one(text, count):
    with pytest.raises(SpecError, match=f"expected exactly one policy, got {count}"):
        parse_policy(text)


def test_parse_policy_two_kinds(extra_policies):
    with pytest.raises(SpecError, match="got 2"):
        parse_policy("streaming_llm+mytest_reuse_a")


# -- parameters_help --------------------------------------------------------------------------


def test_parameters_help(extra_policies):
    assert parameters_help(StreamingLLM) == "sinks (int, default 4)"
    assert parameters_help(MyTestEvict) == "(none)"
    assert parameters_help(MyTestWrap) == "inner (Eviction | None, default None), scale (float, default 1.0)"


def test_parameters_help_required_and_factory_defaults():
    @dataclass
    class Params(Reuse):
        needed: int
        items: tuple[str, ...] = dataclasses.field(default_factory=lambda: ("a",))
        hidden: int = dataclasses.field(default=0, init=False)

    assert parameters_help(Params) == "needed (int, required), items (tuple[str, ...], default ('a',))"


def test_spec_is_frozen():
    spec = parse_spec("streaming_llm")
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.eviction = None
    assert kvlib.Spec is Spec


# -- size limits and what messages echo ----------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("+".join(["h2o"] * 2000), r"^a spec string has at most 4096 characters; got 7999: 'h2o\+h2o"),
        ("+".join(["h2o"] * 65), r"^a spec holds at most 64 policies \(one per kind, and reuse policies\); got 65 terms in"),
        ("+".join(["a"] * 2000), r"^a spec holds at most 64 policies .*; got 2000 terms in 'a\+a\+a"),
        ("(" * 300 + "h2o" + ")" * 300, r"^cannot parse spec '\(\(\(\("),
    ],
    ids=["2000-terms-long", "65-terms", "2000-short-terms", "deep-parentheses"],
)
def test_oversized_specs_are_spec_errors_with_a_cut_echo(text, message):
    with pytest.raises(SpecError, match=message) as info:
        parse_spec(text)
    assert len(str(info.value)) < 400


def test_a_list_of_too_many_policies_is_refused():
    with pytest.raises(SpecError, match="at most 64 policies .*; got a list of 65 items"):
        parse_spec([StreamingLLM()] * 65)


def test_a_huge_unknown_name_is_cut_in_the_message():
    name = "x" * 100_000
    with pytest.raises(SpecError) as info:
        kvlib.get_policy(name)
    message = str(info.value)
    assert message.startswith("unknown policy 'xxxx") and "x...." in message and len(message) < 1_000
    assert "Did you mean" not in message and "eviction: " in message


def test_a_huge_parameter_value_is_cut_in_the_message():
    with pytest.raises(SpecError) as info:
        parse_spec(f"streaming_llm(sinks='{'9' * 3000}')")
    message = str(info.value)
    assert message.startswith("streaming_llm: parameter 'sinks' must be int, got '9999") and len(message) < 200

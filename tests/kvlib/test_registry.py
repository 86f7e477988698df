"""Tests for kvlib.registry: registration rules, look-up, and entry-point plugins."""

import re
import types
import warnings
from dataclasses import dataclass

import pytest
import torch

import kvlib
from kvlib import registry
from kvlib.policies.eviction.streaming_llm import StreamingLLM
from kvlib.policy import KIND_BASES, Budget, Eviction, Policy, Reuse
from kvlib.registry import ENTRY_POINT_GROUP, LEGACY_ENTRY_POINT_GROUP, available_policies, get_policy, register

ALL_KINDS = ("eviction", "budget", "quantization", "lowrank", "reuse", "tiering", "recompute")


# -- test-only policies (registered only inside the `scratch_registry` fixture) -------------


@dataclass
class MyTestEvict(Eviction):
    """A test-only eviction policy."""

    def score(self, view):
        return torch.zeros(view.valid.shape)


@dataclass
class MyTestOtherEvict(Eviction):
    """Another test-only eviction policy, distinct from MyTestEvict."""

    def score(self, view):
        return torch.zeros(view.valid.shape)


@dataclass
class MyTestPluginBudget(Budget):
    """A test-only budget policy, advertised by a fake entry point."""

    fraction: float = 0.5

    def caps(self, request):
        return request.tokens.unsqueeze(-1).expand_as(request.counts)


@dataclass
class MyTestModuleReuse(Reuse):
    """A test-only reuse policy registered by a fake plugin module on import."""


class FakeEntryPoint:
    """Quacks like importlib.metadata.EntryPoint: name, value, load()."""

    def __init__(self, name, value, loader):
        self.name = name
        self.value = value
        self._loader = loader

    def load(self):
        return self._loader()


@pytest.fixture
def fake_plugins(monkeypatch, scratch_registry):
    """Install fake entry points for the kvlib.policies group and force a reload of plugins."""
    groups_asked = []

    def install(*eps):
        def fake_entry_points(*, group):
            groups_asked.append(group)
            return list(eps) if group == ENTRY_POINT_GROUP else []

        monkeypatch.setattr(registry, "entry_points", fake_entry_points)
        monkeypatch.setattr(registry, "_loaded", False)
        return groups_asked

    return install


# -- register: names ------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["SnapKV", "1abc", "a-b", "", "_private", "a b", "snap.kv", "é"])
def test_register_rejects_malformed_names(name):
    with pytest.raises(ValueError, match="policy name must match"):
        register(name)


@pytest.mark.parametrize("name", [None, 3, b"snapkv"])
def test_register_rejects_non_string_names(name):
    with pytest.raises(ValueError, match="policy name must match"):
        register(name)


@pytest.mark.parametrize("name", ["a", "snap_kv_test", "h2o_test", "streaming_llm2", "x_1_y"])
def test_register_accepts_well_formed_names(scratch_registry, name):
    cls = register(name)(MyTestEvict)
    assert cls is MyTestEvict
    assert scratch_registry[name] is MyTestEvict
    assert MyTestEvict.name == name


# -- register: class checks --------------------------------------------------------------


def test_register_rejects_class_that_is_not_a_dataclass(scratch_registry):
    class NotADataclass(Eviction):
        def score(self, view):
            return view.valid.float()

    with pytest.raises(ValueError, match="must be a @dataclass"):
        register("mytest_not_dc")(NotADataclass)
    assert "mytest_not_dc" not in scratch_registry


def test_register_rejects_dataclass_without_kind_base(scratch_registry):
    @dataclass
    class Plain:
        x: int = 1

    with pytest.raises(ValueError, match="must subclass one of kvlib's kind bases") as info:
        register("mytest_plain")(Plain)
    for base in KIND_BASES.values():
        assert base.__name__ in str(info.value)
    assert "mytest_plain" not in scratch_registry


def test_register_rejects_bare_policy_subclass(scratch_registry):
    @dataclass
    class NoKind(Policy):
        x: int = 1

    with pytest.raises(ValueError, match="kind bases"):
        register("mytest_nokind")(NoKind)
    assert "mytest_nokind" not in scratch_registry


@pytest.mark.parametrize("not_a_class", [lambda: None, 42, StreamingLLM()])
def test_register_rejects_non_classes(scratch_registry, not_a_class):
    with pytest.raises(ValueError, match="kind bases"):
        register("mytest_not_a_class")(not_a_class)
    assert "mytest_not_a_class" not in scratch_registry


def test_register_rejects_unknown_needs(scratch_registry):
    @dataclass
    class NeedsLogits(Eviction):
        needs = frozenset({"attention", "logits"})

        def score(self, view):
            return view.valid.float()

    with pytest.raises(ValueError, match="needs unknown inputs") as info:
        register("mytest_needs_logits")(NeedsLogits)
    message = str(info.value)
    assert "logits" in message
    for known in kvlib.policy.NEEDS:
        assert known in message
    assert "mytest_needs_logits" not in scratch_registry


def test_register_accepts_known_needs(scratch_registry):
    @dataclass
    class NeedsAttention(Eviction):
        needs = frozenset({"attention", "queries"})

        def score(self, view):
            return view.attention.sum(-2)

    register("mytest_needs_attention")(NeedsAttention)
    assert get_policy("mytest_needs_attention") is NeedsAttention
    assert "mytest_needs_attention" in available_policies()["eviction"]


def test_register_name_taken_by_another_class_names_both(scratch_registry):
    with pytest.raises(ValueError) as info:
        register("streaming_llm")(MyTestEvict)
    message = str(info.value)
    assert "'streaming_llm'" in message
    assert "kvlib.policies.eviction.streaming_llm.StreamingLLM" in message
    assert f"{MyTestEvict.__module__}.MyTestEvict" in message
    assert scratch_registry["streaming_llm"] is StreamingLLM


def test_register_name_taken_across_kinds(scratch_registry):
    register("mytest_shared")(MyTestEvict)
    with pytest.raises(ValueError, match="taken by"):
        register("mytest_shared")(MyTestPluginBudget)
    assert scratch_registry["mytest_shared"] is MyTestEvict


def test_reregistering_the_same_class_is_fine(scratch_registry):
    before = dict(scratch_registry)
    assert register("streaming_llm")(StreamingLLM) is StreamingLLM
    assert scratch_registry == before
    assert StreamingLLM.name == "streaming_llm"


def test_register_kind_comes_from_base(scratch_registry):
    register("mytest_budget")(MyTestPluginBudget)
    policies = available_policies()
    assert "mytest_budget" in policies["budget"]
    assert all("mytest_budget" not in names for kind, names in policies.items() if kind != "budget")


# -- available_policies / get_policy ---------------------------------------------------------


def test_available_policies_lists_every_kind():
    policies = available_policies()
    assert list(policies) == list(KIND_BASES)
    assert set(policies) == set(ALL_KINDS)
    assert "streaming_llm" in policies["eviction"]
    for names in policies.values():
        assert names == sorted(names)


def test_available_policies_names_are_unique_across_kinds():
    names = [name for names in available_policies().values() for name in names]
    assert len(names) == len(set(names))


def test_get_policy_known_name():
    assert get_policy("streaming_llm") is StreamingLLM
    assert kvlib.get_policy is get_policy


def test_get_policy_unknown_name_lists_kinds_and_suggests():
    with pytest.raises(kvlib.SpecError) as info:
        get_policy("streaming_lm")
    assert isinstance(info.value, ValueError)
    message = str(info.value)
    assert "unknown policy 'streaming_lm'" in message
    assert "Did you mean 'streaming_llm'?" in message
    assert "Valid policies by kind" in message
    for kind in ALL_KINDS:
        assert f"{kind}:" in message
    assert re.search(r"eviction: [a-z0-9_, ]*streaming_llm", message)


def test_get_policy_unknown_name_without_close_match_has_no_hint():
    with pytest.raises(kvlib.SpecError) as info:
        get_policy("qqqqqqqqqq")
    message = str(info.value)
    assert "Did you mean" not in message
    assert "streaming_llm" in message  # still listed as valid


def test_get_policy_error_lists_empty_kinds_as_none(scratch_registry):
    for name in [n for n, cls in scratch_registry.items() if cls.kind == "tiering"]:
        del scratch_registry[name]
    with pytest.raises(kvlib.SpecError, match=r"tiering: \(none\)"):
        get_policy("nope")


# -- entry-point plugins -------------------------------------------------------------------


def test_plugin_class_is_registered_under_entry_point_name(fake_plugins, scratch_registry):
    groups = fake_plugins(FakeEntryPoint("mytest_plugin", "mytest_pkg:MyTestPluginBudget", lambda: MyTestPluginBudget))
    assert "mytest_plugin" not in scratch_registry

    policies = available_policies()

    assert groups == [ENTRY_POINT_GROUP, LEGACY_ENTRY_POINT_GROUP]
    assert "mytest_plugin" in policies["budget"]
    assert "streaming_llm" in policies["eviction"]  # built-ins still there
    assert get_policy("mytest_plugin") is MyTestPluginBudget
    spec = kvlib.parse_spec("streaming_llm(sinks=2)+mytest_plugin(fraction=0.25)")
    assert spec.budget == MyTestPluginBudget(fraction=0.25)
    assert spec.eviction == StreamingLLM(sinks=2)
    assert str(spec) == "streaming_llm(sinks=2)+mytest_plugin(fraction=0.25)"


def test_plugins_load_lazily_and_once(fake_plugins):
    calls = []

    def loader():
        calls.append(1)
        return MyTestPluginBudget

    fake_plugins(FakeEntryPoint("mytest_plugin", "mytest_pkg:MyTestPluginBudget", loader))
    assert calls == []  # nothing loaded until the first look-up
    get_policy("mytest_plugin")
    available_policies()
    with pytest.raises(kvlib.SpecError):
        get_policy("still_unknown")
    assert calls == [1]


def test_plugin_module_registers_its_own_policies(fake_plugins):
    def import_module():
        register("mytest_module_reuse")(MyTestModuleReuse)
        return types.ModuleType("mytest_plugin_module")

    fake_plugins(FakeEntryPoint("mytest_module", "mytest_plugin_module", import_module))
    policies = available_policies()
    assert "mytest_module_reuse" in policies["reuse"]
    assert "mytest_module" not in [n for names in policies.values() for n in names]
    assert kvlib.parse_spec("mytest_module_reuse").reuse == (MyTestModuleReuse(),)


def test_plugin_advertising_an_already_registered_class_adds_no_alias(fake_plugins, scratch_registry):
    fake_plugins(FakeEntryPoint("mytest_alias", "kvlib.policies.eviction:StreamingLLM", lambda: StreamingLLM))
    assert available_policies()["eviction"].count("streaming_llm") == 1
    assert "mytest_alias" not in scratch_registry
    assert StreamingLLM.name == "streaming_llm"


def test_broken_plugin_warns_and_does_not_break_listing(fake_plugins):
    def explode():
        raise ImportError("no module named mytest_broken_pkg")

    fake_plugins(
        FakeEntryPoint("mytest_broken", "mytest_broken_pkg:Thing", explode),
        FakeEntryPoint("mytest_plugin", "mytest_pkg:MyTestPluginBudget", lambda: MyTestPluginBudget),
    )
    with pytest.warns(RuntimeWarning) as record:
        policies = available_policies()

    messages = [str(w.message) for w in record if issubclass(w.category, RuntimeWarning)]
    assert len(messages) == 1
    assert "'mytest_broken'" in messages[0]
    assert "mytest_broken_pkg:Thing" in messages[0]
    assert "no module named mytest_broken_pkg" in messages[0]
    assert set(policies) == set(ALL_KINDS)
    assert "streaming_llm" in policies["eviction"]
    assert "mytest_plugin" in policies["budget"]  # a later good plugin still loads


@pytest.mark.parametrize(
    "name, loaded, problem",
    [
        ("Bad-Name", MyTestPluginBudget, "policy name must match"),
        ("mytest_not_dc", type("NotDC", (Budget,), {}), "must be a @dataclass"),
        ("streaming_llm", MyTestEvict, "is taken by"),
    ],
)
def test_plugin_class_failing_registration_warns(fake_plugins, scratch_registry, name, loaded, problem):
    fake_plugins(FakeEntryPoint(name, f"mytest_pkg:{getattr(loaded, '__name__', loaded)}", lambda: loaded))
    with pytest.warns(RuntimeWarning, match=problem):
        policies = available_policies()
    assert scratch_registry["streaming_llm"] is StreamingLLM
    assert name not in policies["budget"]
    assert set(policies) == set(ALL_KINDS)


def test_no_warning_without_plugins(fake_plugins):
    fake_plugins()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert "streaming_llm" in available_policies()["eviction"]


# -- the old word, "strategy": deprecated aliases for one release ----------------------------


def test_old_function_names_warn_and_answer_like_the_new_ones():
    with pytest.warns(DeprecationWarning, match="available_strategies"):
        assert kvlib.available_strategies() == available_policies()
    with pytest.warns(DeprecationWarning, match="get_strategy"):
        assert kvlib.get_strategy("snapkv") is get_policy("snapkv")
    with pytest.warns(DeprecationWarning, match="kvlib.Strategy"):
        assert kvlib.Strategy is kvlib.Policy
    with pytest.warns(DeprecationWarning, match="kvlib.parse_strategy"):
        assert kvlib.parse_strategy is kvlib.parse_policy
    with pytest.warns(DeprecationWarning, match="Spec.strategies"):
        assert kvlib.parse_spec("snapkv+kivi").strategies() == kvlib.parse_spec("snapkv+kivi").policies()


def test_old_package_names_give_the_same_modules(monkeypatch):
    import importlib
    import sys

    import kvlib.policy

    for name in [name for name in sys.modules if name in ("kvlib.strategies", "kvlib.strategy") or name.startswith("kvlib.strategies.")]:
        monkeypatch.delitem(sys.modules, name)
    with pytest.warns(DeprecationWarning, match="kvlib.strategies"):
        old = importlib.import_module("kvlib.strategies")
    import kvlib.policies.eviction.snapkv as new_module

    assert old is kvlib.policies
    assert importlib.import_module("kvlib.strategies.eviction.snapkv") is new_module
    with pytest.warns(DeprecationWarning, match="kvlib.strategy"):
        old_api = importlib.import_module("kvlib.strategy")
    assert old_api is kvlib.policy and old_api.Strategy is kvlib.policy.Policy


def test_plugins_in_the_old_entry_point_group_still_load_with_a_warning(monkeypatch, scratch_registry):
    entry = FakeEntryPoint("mytest_legacy", "mytest_pkg:MyTestPluginBudget", lambda: MyTestPluginBudget)
    monkeypatch.setattr(registry, "entry_points", lambda *, group: [entry] if group == LEGACY_ENTRY_POINT_GROUP else [])
    monkeypatch.setattr(registry, "_loaded", False)

    with pytest.warns(DeprecationWarning, match=ENTRY_POINT_GROUP):
        assert get_policy("mytest_legacy") is MyTestPluginBudget

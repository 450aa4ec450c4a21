"""One registry idiom: duplicates refused, misses list the valid keys, order kept."""

from __future__ import annotations

import pytest

from memtrim.analysis import CATEGORY_RULES, ROLE_RULES
from memtrim.analysis.allocator import CHARGE_RULES
from memtrim.doctor import DIAGNOSES
from memtrim.registry import DuplicateRegistration, Registry, UnknownKey


def test_register_refuses_a_second_rule_for_a_key() -> None:
    rules: Registry[str, object] = Registry("test rule", "rules.register(name)")

    @rules.register("a", "b")
    def first() -> None: ...

    with pytest.raises(DuplicateRegistration, match=r"already registered for 'b'.*first"):

        @rules.register("c", "b")
        def second() -> None: ...

    assert rules.keys() == ["a", "b"]  # nothing half-registered
    assert rules["a"] is first


def test_a_miss_names_the_valid_keys_and_how_to_add_one() -> None:
    rules: Registry[str, int] = Registry("charge rule", "CHARGE_RULES.register(device_type)")
    rules.add("cuda", 1)
    rules.add("xpu", 2)
    with pytest.raises(UnknownKey) as info:
        rules["mps"]
    assert str(info.value) == (
        "no charge rule is registered for 'mps'; valid: 'cuda', 'xpu' "
        "(add one with CHARGE_RULES.register(device_type))"
    )
    assert rules.get("mps") is None and rules.get("mps", 7) == 7
    assert isinstance(info.value, KeyError)


def test_order_is_registration_order() -> None:
    rules: Registry[str, int] = Registry("rule", "r")
    for i, name in enumerate("zyx"):
        rules.add(name, i)
    assert list(rules) == ["z", "y", "x"] and rules.values() == [0, 1, 2]
    assert rules.unregister("y") == 1 and "y" not in rules


@pytest.mark.parametrize("registry", [CATEGORY_RULES, ROLE_RULES, DIAGNOSES, CHARGE_RULES])
def test_every_analysis_rule_table_is_a_registry(registry: Registry[str, object]) -> None:
    assert isinstance(registry, Registry) and len(registry) > 0
    first = registry.keys()[0]
    with pytest.raises(DuplicateRegistration):
        registry.register(first)(lambda *a: None)

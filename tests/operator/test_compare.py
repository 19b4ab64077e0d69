"""What counts as drift of a child: a value the operator set that differs, not what others add."""

from __future__ import annotations

from kvpilot.operator.compare import covers


def test_fields_only_the_live_object_has_are_not_drift() -> None:
    assert covers({"image": "a", "terminationMessagePath": "/dev/termination-log"}, {"image": "a"})


def test_a_changed_value_is_drift() -> None:
    assert not covers({"image": "other:1"}, {"image": "a"})


def test_lists_compare_item_by_item_and_by_length() -> None:
    env = [{"name": "A", "value": "1"}]
    assert covers([{"name": "A", "value": "1", "extra": True}], env)
    assert not covers([{"name": "A", "value": "1"}, {"name": "B", "value": "2"}], env)
    assert not covers([], env)


def test_quantities_compare_by_value() -> None:
    assert covers({"cpu": "500m", "nvidia.com/gpu": "1", "memory": "16Gi"},
                  {"cpu": "0.5", "nvidia.com/gpu": 1, "memory": "16Gi"})
    assert not covers({"cpu": "4"}, {"cpu": "0.5"})
    assert not covers({"maxSurge": "50%"}, {"maxSurge": "25%"})


def test_booleans_are_not_numbers() -> None:
    assert not covers({"readOnly": 1}, {"readOnly": True})
    assert covers({"readOnly": True}, {"readOnly": True})

"""node.engine.constraint's schema closing: what a grammar lets a model add to an object beyond its properties."""

from __future__ import annotations

from kvmesh.node.engine.constraint import closed


def test_an_object_naming_its_properties_is_closed_to_others() -> None:
    """Listed properties and nothing said of others: additionalProperties false, nested objects too."""
    s = closed({"type": "object", "properties": {"city": {"type": "object", "properties": {"name": {"type": "string"}}}}})
    assert s["additionalProperties"] is False
    assert s["properties"]["city"]["additionalProperties"] is False


def test_an_empty_properties_object_and_an_explicit_choice_stay_as_written() -> None:
    """`properties: {}` names none (a tool taking any arguments): left open; an explicit additionalProperties is kept."""
    assert "additionalProperties" not in closed({"type": "object", "properties": {}})
    kept = closed({"type": "object", "properties": {"a": {}}, "additionalProperties": {"type": "integer"}})
    assert kept["additionalProperties"] == {"type": "integer"}

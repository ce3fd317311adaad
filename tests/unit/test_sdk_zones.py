"""harness_sdk.zones: canonical rendering, tool freezing, the volatile-data lint, change detection."""

from __future__ import annotations

import pytest

from harness_sdk import Context, LayoutError, canonical_json, freeze_tools, lint_volatile
from harness_sdk.zones import check_stability, lint_context

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "run_tests",
            "parameters": {"type": "object", "properties": {"k": {"type": "string"}}},
        },
    },
    {
        "type": "function",
        "function": {"parameters": {"properties": {}, "type": "object"}, "name": "apply_patch"},
    },
]


def test_canonical_json_is_deterministic() -> None:
    a = {"b": [1, {"z": 1, "a": 2}], "a": "é"}
    b = {"a": "é", "b": [1, {"a": 2, "z": 1}]}
    assert canonical_json(a) == canonical_json(b) == '{"a":"é","b":[1,{"a":2,"z":1}]}'
    with pytest.raises(ValueError):
        canonical_json({"x": float("nan")})


def test_freeze_tools_orders_by_name_and_sorts_keys() -> None:
    frozen = freeze_tools(TOOLS)
    assert [t["function"]["name"] for t in frozen] == ["apply_patch", "run_tests"]
    assert frozen == freeze_tools(list(reversed(TOOLS)))
    assert list(frozen[0]) == ["function", "type"]
    assert list(frozen[0]["function"]) == ["name", "parameters"]
    with pytest.raises(LayoutError, match="duplicate"):
        freeze_tools([TOOLS[0], TOOLS[0]])
    with pytest.raises(LayoutError, match="without a name"):
        freeze_tools([{"type": "function"}])


@pytest.mark.parametrize(
    ("text", "kind"),
    [
        ("Current time: 2025-03-04T10:22:01Z", "iso_timestamp"),
        ("session 123e4567-e89b-12d3-a456-426614174000", "uuid"),
        ("trace req_8f3a9b2c1d0e", "request_id"),
        ("now=1712345678", "unix_epoch"),
        ("at 13:45:10 today", "clock_time"),
        ("today is 2024-12-31", "date"),
    ],
)
def test_lint_flags_volatile_data(text: str, kind: str) -> None:
    kinds = [f.kind for f in lint_volatile(text, "system")]
    assert kind in kinds


def test_lint_ignores_plain_text() -> None:
    assert (
        lint_volatile("You are a careful coding agent. Use tools; version 3.11; port 8000.") == []
    )


def test_render_boundaries_and_aging_keep_order() -> None:
    ctx = Context("sys", TOOLS, [{"role": "user", "content": "repo facts"}], recent_turns=1)
    ctx.observe("first")
    r0 = ctx.render()
    assert r0.boundaries == {
        "system": (0, 1),
        "tools": (1, 1),
        "memory": (1, 2),
        "recent": (2, 2),
        "observation": (2, 3),
    }
    ctx.commit_turn({"role": "assistant", "content": "a1"})
    ctx.observe("second")
    ctx.commit_turn({"role": "assistant", "content": "a2"})
    ctx.observe("third")
    r = ctx.render()
    # turn 1 aged into memory, turn 2 is recent, "third" is the observation
    assert r.boundaries["memory"] == (1, 4)
    assert r.boundaries["recent"] == (4, 6)
    assert r.boundaries["observation"] == (6, 7)
    assert [m["content"] for m in r.messages] == [
        "sys",
        "repo facts",
        "first",
        "a1",
        "second",
        "a2",
        "third",
    ]
    assert r.zone_of_message(0) == "system" and r.zone_of_message(6) == "observation"
    assert r.zone_of_message(99) is None
    assert {z["name"] for z in r.zones_param()} == {
        "system",
        "tools",
        "memory",
        "recent",
        "observation",
    }
    assert check_stability(r0, r) == []  # aging and appending never count as a change


def test_tools_as_message_is_canonical() -> None:
    a = Context("sys", TOOLS, tools_as="message").render()
    b = Context("sys", list(reversed(TOOLS)), tools_as="message").render()
    assert a.messages == b.messages
    assert a.boundaries["tools"] == (1, 2)
    with pytest.raises(LayoutError):
        Context(tools_as="bogus")  # type: ignore[arg-type]


def test_check_stability_reports_changed_zones_with_diff() -> None:
    ctx = Context("You are helpful.", TOOLS, [{"role": "user", "content": "fact A"}])
    ctx.observe("q1")
    old = ctx.render()
    ctx.commit_turn({"role": "assistant", "content": "ok"})
    ctx.system = "You are helpful. Today is 2025-01-01."
    ctx.remember("fact B")  # inserted before history: breaks the prefix too
    new = ctx.render()
    changes = check_stability(old, new, turn=2)
    assert [c.zone for c in changes] == ["system"]  # memory: old memory is a prefix of new
    assert (
        '-"You are helpful."' in changes[0].diff
        and '+"You are helpful. Today is 2025-01-01."' in changes[0].diff
    )
    ctx.observe("q2")
    ctx.commit_turn({"role": "assistant", "content": "ok2"})
    ctx.recent_turns = 0  # history ages into memory...
    mid = ctx.render()
    ctx.memory.insert(
        0, {"content": "new first fact", "role": "user"}
    )  # ...then memory is rewritten
    changes = check_stability(mid, ctx.render())
    assert [c.zone for c in changes] == ["memory"]
    assert "new first fact" in changes[0].diff
    findings = lint_context(new)
    assert [(f.zone, f.kind) for f in findings] == [("system", "date")]

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from agentkv_vllm.params import parse_request_params


def test_no_agentkv_key_is_vanilla_without_warning() -> None:
    assert parse_request_params(None).params is None
    assert parse_request_params({"other": 1}).warning is None


def test_valid_params() -> None:
    r = parse_request_params(
        {
            "agentkv": {
                "trajectory_id": "t-1",
                "branch": "b",
                "zones": [{"name": "system", "start_token": 0, "end_token": 10}],
                "extra": 1,
            }
        }
    )
    assert r.params is not None and r.params.branch == "b" and r.params.zones[0].end_token == 10


@pytest.mark.parametrize(
    "raw",
    [
        {"agentkv": {"trajectory_id": 5}},
        {"agentkv": {"trajectory_id": "x" * 300}},
        {"agentkv": {"trajectory_id": "bad id with spaces"}},
        {"agentkv": []},
        "string",
    ],
)
def test_malformed_params_warn_and_never_raise(raw: object) -> None:
    r = parse_request_params(raw)
    assert r.params is None and r.warning


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"trajectory_id": "team/run-1"}, "trajectory_id"),
        ({"trajectory_id": "t1", "branch": "main/retry"}, "branch"),
        ({"trajectory_id": ".."}, "trajectory_id"),
        ({"trajectory_id": "t1", "branch": ""}, "branch"),
    ],
)
def test_unroutable_ids_are_served_vanilla_with_one_warning(
    body: dict[str, object], field: str
) -> None:
    """The params accept exactly the ids the routes can serve (agentkv.ids): an id with ``/``
    would be pinned but could never be paused, so the request is served as vanilla."""
    r = parse_request_params({"agentkv": body})
    assert r.params is None
    assert r.warning is not None and f"agentkv.{field}:" in r.warning
    assert "not allowed" in r.warning or "'.' or '..'" in r.warning or "empty" in r.warning


def test_params_follow_the_shared_grammar() -> None:
    from agentkv.ids import is_valid_id

    for value in ["a@b:c.d_e-f", "...", "a/b", "a b", "é", "x" * 257]:
        r = parse_request_params({"agentkv": {"trajectory_id": value, "branch": value}})
        assert (r.params is not None) == is_valid_id(value), value


def test_a_prefetch_ticket_is_32_hex_digits_or_the_request_is_vanilla() -> None:
    ok = parse_request_params({"agentkv": {"trajectory_id": "t1", "prefetch": "0f" * 16}})
    assert ok.params is not None and ok.params.prefetch == "0f" * 16
    bad = parse_request_params({"agentkv": {"trajectory_id": "t1", "prefetch": "x"}})
    assert bad.params is None and bad.warning is not None and "prefetch" in bad.warning


def test_a_request_can_name_the_pause_that_follows_it() -> None:
    r = parse_request_params(
        {
            "agentkv": {
                "trajectory_id": "t",
                "pause_after": {"tools": ["pytest", "grep"], "expected_wait_s": 3},
            }
        }
    )
    assert r.params is not None and r.params.pause_after is not None
    assert r.params.pause_after.tool_names == ["pytest", "grep"]
    assert parse_request_params({"agentkv": {"trajectory_id": "t"}}).params.pause_after is None  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("pause_after", "field"),
    [
        ({}, "pause_after"),  # neither tool nor tools
        ({"tool": ""}, "pause_after.tool"),
        ({"tool": "t", "expected_wait_s": -1}, "pause_after.expected_wait_s"),
        ({"tool": "t", "max_lease_s": 0}, "pause_after.max_lease_s"),
        ({"tool": "t", "wait": 1}, "pause_after.wait"),  # a typo is not silently dropped
    ],
)
def test_a_malformed_pause_after_is_vanilla_and_the_warning_names_it(
    pause_after: dict[str, object], field: str
) -> None:
    r = parse_request_params({"agentkv": {"trajectory_id": "t", "pause_after": pause_after}})
    assert r.params is None
    assert r.warning is not None and f"agentkv.{field}" in r.warning


def test_the_pause_route_and_pause_after_share_one_definition() -> None:
    from agentkv_vllm.params import PauseSpec
    from agentkv_vllm.routes import PauseBody

    assert issubclass(PauseBody, PauseSpec)

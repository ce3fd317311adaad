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

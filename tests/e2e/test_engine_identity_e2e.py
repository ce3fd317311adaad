"""Engine-side trajectory identity on the real server (issue 41): SkyRL 0.3 drives vLLM over its
token-in/token-out route, which the API middleware does not hook; its session id reaches the
engine only as vLLM's ``Request.session_id``.

SkyRL's call (SkyRL 0.3, read from its released source: ``remote_inference_client.py`` ~460-501,
``skyrl_gym_generator.py`` ~325): ``POST /inference/v1/generate {token_ids, sampling_params,
model}`` with the header ``X-Session-ID: {instance_id}_{repetition_id}``. vLLM 0.32 serves that
route only with ``--enable-scale-out`` (the shared server has it)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.e2e.conftest import Server, long_text

pytestmark = pytest.mark.e2e

SAMPLING = {"max_tokens": 4, "temperature": 0, "ignore_eos": True}


def _generate(
    server: Server, tokens: list[int], session: str | None, salt: str | None = None
) -> dict[str, Any]:
    body: dict[str, Any] = {"model": server.model, "token_ids": tokens, "sampling_params": SAMPLING}
    if salt is not None:
        body["cache_salt"] = salt
    headers = {"X-Session-ID": session} if session is not None else {}
    r = server.client.post("/inference/v1/generate", json=body, headers=headers)
    r.raise_for_status()
    return dict(r.json())


def test_skyrl_session_resumes_its_trajectory_from_the_host_tier(server: Server) -> None:
    session = "django__django-11099_0"  # SkyRL's {instance_id}_{repetition_id}
    prompt = server.tokenize(
        [
            {"role": "system", "content": "You are a coding agent. " + long_text(4100, 400)},
            {"role": "user", "content": "Fix the failing test."},
        ]
    )
    first = _generate(server, prompt, session)
    stats = first["kv_transfer_params"]["agentkv"]
    assert stats["trajectory_id"] == session and stats["identified_by"] == "session_id", stats
    assert stats["turn"] == 1
    # The environment step: no pause call (SkyRL makes none); after the grace the finished
    # turn's blocks take the default action, a host copy.
    server.wait_state(session, {"offloaded"})
    server.reset_prefix_cache()  # vLLM forgets: only the host tier holds the context
    observation = server.tokenize([{"role": "user", "content": long_text(4101, 60)}])
    second_tokens = [*prompt, *first["choices"][0]["token_ids"], *observation]
    second = _generate(server, second_tokens, session)
    stats = second["kv_transfer_params"]["agentkv"]
    assert stats["trajectory_id"] == session and stats["turn"] == 2, stats
    assert stats["tier_hit_tokens"] > 0 and stats["tier"] == "host", stats
    # Exact KV: the same two turns from vLLM's own cache (salted: no tier) give the same tokens.
    _generate(server, prompt, None, salt="skyrl-ref")
    ref = _generate(server, second_tokens, None, salt="skyrl-ref")
    assert ref.get("kv_transfer_params") is None  # no session: a vanilla request
    assert second["choices"][0]["token_ids"] == ref["choices"][0]["token_ids"]
    server.end(session)

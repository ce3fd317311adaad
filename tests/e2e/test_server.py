"""Foundation: `agentkv serve` starts the real OpenAI server with the plugin loaded."""

from __future__ import annotations

import httpx
import pytest

from tests.e2e.conftest import Server, full_blocks, long_text

pytestmark = pytest.mark.e2e


def test_health_and_chat(server: Server) -> None:
    assert httpx.get(server.base_url + "/health", timeout=5).status_code == 200
    out = server.chat([{"role": "user", "content": "hello"}])
    assert out["choices"][0]["message"]["content"] is not None
    assert out["usage"]["completion_tokens"] == 4


def test_repeated_long_prompt_is_cached(server: Server) -> None:
    msgs = [{"role": "user", "content": long_text(1, 600)}]
    first = server.chat(msgs, salt="repeat")
    second = server.chat(msgs, salt="repeat")
    assert first["usage"]["prompt_tokens"] > 256
    # Every full block but the one holding the last prompt token (vLLM always computes that).
    expected = full_blocks(first["usage"]["prompt_tokens"] - 1)
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == expected


def test_plugin_entry_point_ran_inside_engine(server: Server) -> None:
    server.chat([{"role": "user", "content": "ping"}])
    engine = server.status()["engine"]
    # The status comes from the scheduler-side connector: it runs in the engine core process,
    # which is not the API server process, and the worker reported its own pid.
    assert engine["plugin_registrations"] >= 1
    assert engine["pid"] != server.proc.pid
    assert engine["worker_pids"], "worker-side connector never reported"
    assert engine["pid"] not in engine["worker_pids"].values()

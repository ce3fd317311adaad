"""The official ``anthropic`` client as an agentkv trajectory: a drop-in for agent loops that
speak the Anthropic Messages API to vLLM (``/v1/messages``).

    from anthropic import Anthropic
    from harness_sdk.anthropic import wrap

    # vLLM checks ``Authorization: Bearer``: give the key as auth_token (not api_key)
    client = wrap(Anthropic(base_url="http://127.0.0.1:8000", auth_token=KEY), "task-42")
    msg = client.messages.create(model="tiny", max_tokens=64, messages=msgs, tools=TOOLS)
    # a reply with tool_use blocks auto-pauses the trajectory on the server
    with client.tool("get_weather", expected_s=2) as call:   # optional: pause, measure, resume
        output = get_weather(**msg.content[-1].input)
    ...
    client.close()                                            # DELETE the trajectory

Every ``messages.create`` / ``messages.stream`` / ``messages.parse`` call (and the same on
``beta.messages``, which pydantic-ai's Anthropic model calls, and through ``with_raw_response`` /
``with_streaming_response``) gets ``extra_headers={"x-session-id": trajectory_id}`` and
``extra_body={"kv_transfer_params": {"agentkv": {...}}}`` merged into what the caller passes,
exactly like ``harness_sdk.openai.wrap`` (which this reuses: ``with_options`` returns a wrapped
client, other calls carry the session header). The agentkv
routes (``tool()``, ``close()``) use the client's ``auth_token`` (else ``api_key``) as the
bearer key unless ``api_key=`` is given.

Primitives:
  wrap(client, trajectory_id=None, branch="main", ...) -> AnthropicTrajectory |
                                                          AsyncAnthropicTrajectory
  AnthropicTrajectory        sync: ``.messages.create``, ``with .tool(...)``, ``.close()``
  AsyncAnthropicTrajectory   async: the same with ``await`` / ``async with``
Every other attribute is the wrapped client's. The ``anthropic`` package is never imported
here (duck typing).
"""

from __future__ import annotations

from typing import Any

from harness_sdk.openai import AsyncOpenAITrajectory, OpenAITrajectory, _Create


class AnthropicTrajectory(OpenAITrajectory):
    """An ``anthropic.Anthropic`` client bound to one trajectory branch."""

    @property
    def messages(self) -> _Create:
        return _Create(self, self._routed.messages)


class AsyncAnthropicTrajectory(AsyncOpenAITrajectory):
    """An ``anthropic.AsyncAnthropic`` client bound to one trajectory branch."""

    @property
    def messages(self) -> _Create:
        return _Create(self, self._routed.messages)


def _is_async(client: Any) -> bool:
    return "async" in type(client).__name__.lower()


def wrap(
    client: Any,
    trajectory_id: str | None = None,
    branch: str = "main",
    **kwargs: Any,
) -> Any:
    """Bind an ``anthropic.Anthropic`` (-> AnthropicTrajectory) or ``anthropic.AsyncAnthropic``
    (-> AsyncAnthropicTrajectory) client to one trajectory branch. Options as
    ``harness_sdk.openai.wrap``."""
    if kwargs.get("api_key") is None:
        kwargs["api_key"] = getattr(client, "auth_token", None) or getattr(client, "api_key", None)
    cls = AsyncAnthropicTrajectory if _is_async(client) else AnthropicTrajectory
    return cls(client, trajectory_id, branch, **kwargs)


__all__ = ["AnthropicTrajectory", "AsyncAnthropicTrajectory", "wrap"]

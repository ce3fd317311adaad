"""One streamed (SSE) request as every bench driver measures it.

Primitives:
  Streamed          one request's TTFT, latency and usage counts
  stream_measured(client, url, body, headers=, what=) -> Streamed   POST, read to the end
  usage_counts(usage) -> (prompt, cached, completion)   from an OpenAI ``usage`` object

TTFT is the wall time from just before the request is sent to the arrival of the first SSE
chunk that carries a choice (no chunk with a choice: the whole latency). Usage comes from the
final chunk (``stream_options.include_usage``). A 4xx/5xx answer raises RuntimeError naming
``what``, the status and the start of the body.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import httpx

from agentkv.errors import ConfigError
from harness_sdk.sse import sse_data


@dataclass
class Streamed:
    ttft_s: float
    latency_s: float
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int


def usage_counts(usage: Mapping[str, Any] | None) -> tuple[int, int, int]:
    """(prompt, cached, completion) tokens of an OpenAI ``usage`` object; 0 where absent."""
    usage = usage or {}
    details = usage.get("prompt_tokens_details") or {}
    return (
        int(usage.get("prompt_tokens") or 0),
        int(details.get("cached_tokens") or 0),
        int(usage.get("completion_tokens") or 0),
    )


async def stream_measured(
    client: httpx.AsyncClient,
    url: str,
    body: dict[str, Any],
    headers: dict[str, str] | None = None,
    what: str = "completion",
) -> Streamed:
    """POST ``body`` (a streaming request) to ``url`` and read the whole reply."""
    ttft: float | None = None
    usage: dict[str, Any] = {}
    t0 = time.monotonic()
    async with client.stream("POST", url, json=body, headers=headers) as r:
        if r.status_code >= 400:
            await r.aread()
            if r.status_code == 400 and "maximum context length" in r.text:
                raise ConfigError(
                    f"{what} refused: longer than the server's --max-model-len "
                    f"({r.text[:300]}). A bench run sets it from its smallest --num-blocks "
                    "((blocks - 1) x 128 tokens): give a larger smallest pool, or fewer turns"
                )
            raise RuntimeError(f"{what} failed: {r.status_code} {r.text[:300]}")
        async for data in sse_data(r):
            chunk = json.loads(data)
            if chunk.get("choices") and ttft is None:
                ttft = time.monotonic() - t0
            if chunk.get("usage"):
                usage = chunk["usage"]
    latency = time.monotonic() - t0
    return Streamed(ttft if ttft is not None else latency, latency, *usage_counts(usage))

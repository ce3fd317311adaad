"""Server-sent events as the OpenAI-compatible streaming routes send them (one reader for the
SDK's streamed turns and the bench drivers).

Primitives:
  sse_data(response) -> AsyncIterator[str]   the payload of each ``data:`` line, up to ``[DONE]``

Other lines (comments, ``event:``, blank keep-alives) are skipped; the caller decodes the
payload (the SDK tolerates a bad chunk, the bench lets it raise).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx

DONE = "[DONE]"


async def sse_data(response: httpx.Response) -> AsyncIterator[str]:
    """Yield each ``data:`` payload of a streamed response, stripped; stop at ``[DONE]``."""
    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == DONE:
            return
        yield data

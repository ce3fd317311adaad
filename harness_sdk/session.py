"""One trajectory's connection to its server: the HTTP client, the agentkv routes, the flags
every branch shares (the request/response plumbing under Trajectory and the wrapped clients).

Primitives:
  _Shared(base_url, model, api_key, trajectory_id, adapter, client, timeout, telemetry,
          cache_salt=None)
    await .request(method, path, json) -> httpx.Response   one call, its session header on it
                                                           (and its tenant on a control call)
    .turn_extra(extra_body) -> dict | None   a turn's extra body with the tenant's cache_salt
    await .send_turn(body, stream) -> (payload, latency_s, ttft_s)   one chat turn, or its error
    await .stream_chat(path, json, headers) -> (status, payload, ttft_s)   SSE, reassembled
    await .control(method, path, json, quiet=, expect_known=) -> dict | None   an agentkv route
                                     (None: absent; a 404 of an ``expect_known`` call warns)
    await .trajectory_state() / .server_status() -> dict | None   the two GET routes
    await .close_trajectory(used) -> dict | None   DELETE once (when used), close our client
    .degrade(why) / .check_pause_reply(branch, reply)   the once-per-trajectory warnings
  _check_id(value, what)     a trajectory id or branch name in the ``agentkv.ids`` grammar
  _check_salt(value)         a ``cache_salt`` option: None or a non-empty string

The tenant: ``cache_salt`` (one option of the trajectory or wrapped client) goes on every call
the SDK makes: each turn's body ``cache_salt`` (vLLM's per-request salt, so the trajectory's KV
lives in the tenant's namespace) and each control call's ``X-AgentKV-Cache-Salt`` header and
``cache_salt`` body field (vllm-router drops unknown headers); a turn's ``extra_body`` that names
another salt is a ConfigError.
  _normalize_base(url)       the server's base URL (no trailing ``/v1``); ConfigError if not http(s)
The names are private to the SDK: trajectory.py, tool_wait.py and openai.py share them.
"""

from __future__ import annotations

import json as jsonlib
import logging
import time
import warnings
from typing import Any
from urllib.parse import urlsplit

import httpx

from agentkv import ids as _ids
from harness_sdk.adapters import SESSION_HEADER, Adapter
from harness_sdk.errors import (
    AuthenticationError,
    ConfigError,
    DegradedWarning,
    InvalidIdError,
    PauseNotAppliedWarning,
    TimeoutError_,
    TrajectoryNotFoundWarning,
    TransportError,
    status_error,
)
from harness_sdk.sse import sse_data
from harness_sdk.telemetry import Telemetry
from harness_sdk.zones import LintFinding

log = logging.getLogger("harness_sdk")


def _check_id(value: object, what: str) -> str:
    """``value`` when it is in the id grammar of ``agentkv.ids``, else InvalidIdError."""
    try:
        return _ids.validate_id(value, what)
    except _ids.InvalidIdError as exc:
        raise InvalidIdError(str(exc)) from None


def _check_salt(value: object) -> str | None:
    """A ``cache_salt`` option: None (the unsalted namespace) or a non-empty string."""
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise ConfigError(f"cache_salt must be a non-empty string or None, got {value!r}")
    return value


class _Shared:
    """State shared by every branch of one trajectory: the HTTP client, routes, closed flag."""

    def __init__(
        self,
        base_url: str,
        model: str,
        api_key: str | None,
        trajectory_id: str,
        adapter: Adapter,
        client: httpx.AsyncClient | None,
        timeout: float,
        telemetry: Telemetry,
        cache_salt: str | None = None,
    ) -> None:
        self.base_url = base_url
        self.model = model
        self.api_key = api_key
        self.trajectory_id = trajectory_id
        self.adapter = adapter
        self.owns_client = client is None
        self.client = client or httpx.AsyncClient(timeout=timeout)
        self.telemetry = telemetry
        self.cache_salt = _check_salt(cache_salt)
        self.routes: bool | None = None if adapter.supports_control else False
        self.closed = False
        self.seen_lint: set[LintFinding] = set()
        self.warned_pause_not_applied = False
        parts = urlsplit(base_url)
        self.server = (parts.hostname or "", parts.port)

    def session_headers(self, headers: dict[str, str]) -> dict[str, str]:
        """The routing contract: every call names its session (routers such as vllm-router key
        session affinity on it)."""
        return {**headers, SESSION_HEADER: self.trajectory_id}

    async def request(self, method: str, path: str, json: Any = None) -> httpx.Response:
        if path.startswith("/agentkv/"):
            headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
            # vllm-router drops client headers on routes it does not know: the model and the
            # session travel in the body too, as on the trajectory's chat calls.
            json = {**(json or {}), "agent_hint": self.agent_hint()}
            if self.model:
                json["model"] = self.model
            if self.cache_salt:
                # The trajectory's tenant: without it the route addresses the unsalted
                # namespace and answers 404 for a salted trajectory.
                headers[_ids.TENANT_HEADER] = self.cache_salt
                json[_ids.TENANT_FIELD] = self.cache_salt
        else:
            headers = self.adapter.headers(self.api_key)
        headers = self.session_headers(headers)
        try:
            return await self.client.request(
                method, self.base_url + path, json=json, headers=headers
            )
        except httpx.TimeoutException as exc:
            raise TimeoutError_(f"{method} {path} timed out: {exc}") from exc
        except httpx.TransportError as exc:
            raise TransportError(f"{method} {path} failed: {exc!r}") from exc

    async def send_turn(
        self, body: dict[str, Any], stream: bool
    ) -> tuple[Any, float, float | None]:
        """POST one turn on the adapter's path; return (payload, latency_s, ttft_s).

        ``stream`` sends it as SSE with the final usage chunk (ttft_s set; None otherwise). An
        error status raises its HarnessError (``status_error``) once the latency is measured.
        """
        ttft: float | None = None
        t0 = time.monotonic()
        if stream:
            body = {**body, "stream": True, "stream_options": {"include_usage": True}}
            status, payload, ttft = await self.stream_chat(
                self.adapter.path,
                body,
                self.session_headers(self.adapter.headers(self.api_key)),
            )
            latency = time.monotonic() - t0
            if status >= 400:
                raise status_error(status, payload, self.base_url + self.adapter.path)
        else:
            r = await self.request("POST", self.adapter.path, body)
            latency = time.monotonic() - t0
            payload = _json(r)
            if r.status_code >= 400:
                raise status_error(r.status_code, payload, str(r.request.url))
        return payload, latency, ttft

    def turn_extra(self, extra: dict[str, Any] | None) -> dict[str, Any] | None:
        """A turn's ``extra_body`` with the tenant's ``cache_salt``; ConfigError when it names
        another salt (its KV and trajectory would be another tenant's than the control calls')."""
        given = (extra or {}).get(_ids.TENANT_FIELD)
        if given is not None and given != self.cache_salt:
            raise ConfigError(
                f"extra_body cache_salt {given!r} differs from the trajectory's cache_salt "
                f"{self.cache_salt!r}: set it once, as the cache_salt= option, so every call "
                "(turns and control calls) names the same tenant"
            )
        if not self.cache_salt:
            return extra
        return {**(extra or {}), _ids.TENANT_FIELD: self.cache_salt}

    def agent_hint(self) -> dict[str, str]:
        return {"session_id": self.trajectory_id}

    async def stream_chat(
        self, path: str, json: Any, headers: dict[str, str]
    ) -> tuple[int, Any, float | None]:
        """POST a streaming (SSE) chat request; return (status, payload, ttft_s).

        The payload is reassembled into the shape of a non-streamed response (one choice, the
        concatenated content, the final usage chunk) so adapters parse both alike.
        """
        t0 = time.monotonic()
        ttft: float | None = None
        content: list[str] = []
        reasons: dict[int, str] = {}
        payload: dict[str, Any] = {}
        role = "assistant"
        try:
            async with self.client.stream(
                "POST", self.base_url + path, json=json, headers=headers
            ) as r:
                if r.status_code >= 400:
                    await r.aread()
                    return r.status_code, _json(r), None
                async for data in sse_data(r):
                    chunk = _loads(data)
                    if not isinstance(chunk, dict):
                        continue
                    for key in ("id", "model", "usage"):
                        if chunk.get(key) is not None:
                            payload[key] = chunk[key]
                    for choice in chunk.get("choices") or []:
                        if ttft is None:
                            ttft = time.monotonic() - t0
                        delta = choice.get("delta") or {}
                        role = delta.get("role") or role
                        if delta.get("content"):
                            content.append(str(delta["content"]))
                        if choice.get("finish_reason"):
                            reasons[int(choice.get("index", 0))] = str(choice["finish_reason"])
        except httpx.TimeoutException as exc:
            raise TimeoutError_(f"POST {path} timed out: {exc}") from exc
        except httpx.TransportError as exc:
            raise TransportError(f"POST {path} failed: {exc!r}") from exc
        payload["choices"] = [
            {
                "index": 0,
                "message": {"role": role, "content": "".join(content)},
                "finish_reason": reasons.get(0),
            }
        ]
        return 200, payload, ttft

    def degrade(self, why: str) -> None:
        if self.routes is not False:
            self.routes = False
            warnings.warn(
                f"agentkv routes unavailable ({why}); pause/resume/close are skipped",
                DegradedWarning,
                stacklevel=4,
            )
            log.warning("harness_sdk: agentkv routes unavailable (%s)", why)

    def check_pause_reply(self, branch: str, reply: dict[str, Any] | None) -> None:
        """Warn (once per trajectory) when the engine did not apply a pause decision."""
        if reply is None or reply.get("applied") is not False or self.warned_pause_not_applied:
            return
        self.warned_pause_not_applied = True
        decision = reply.get("decision")
        action = decision.get("action") if isinstance(decision, dict) else None
        why = ", ".join(
            f"{key}={reply[key]!r}"
            for key in ("state", "reason", "detail")
            if reply.get(key) is not None
        )
        msg = (
            f"the engine did not apply the pause decision"
            f"{f' ({action})' if action else ''} for trajectory {self.trajectory_id!r} "
            f"branch {reply.get('branch') or branch!r}"
            f"{f' ({why})' if why else ''}: the KV is not (yet) where the decision puts it; "
            "see server_state(). Warned once per trajectory"
        )
        warnings.warn(msg, PauseNotAppliedWarning, stacklevel=3)
        log.warning("harness_sdk: %s", msg)

    async def control(
        self,
        method: str,
        path: str,
        json: Any = None,
        *,
        quiet: bool = True,
        expect_known: bool = False,
    ) -> dict[str, Any] | None:
        """Call an agentkv route. None when the routes are absent or the trajectory is unknown.

        Raises AuthenticationError always; other failures raise only when ``quiet`` is False.
        ``expect_known`` (pause, resume, DELETE of a trajectory that sent turns): a 404 for the
        trajectory is a TrajectoryNotFoundWarning (the server does not know it in this tenant:
        another cache_salt, expired, or restarted), not silence.
        """
        if self.routes is False:
            return None
        try:
            r = await self.request(method, "/agentkv/v1" + path, json)
        except TransportError as exc:
            if not quiet:
                raise
            log.warning("harness_sdk: %s %s failed: %s", method, path, exc)
            return None
        body = _json(r)
        if r.status_code < 400:
            self.routes = True
            return body if isinstance(body, dict) else {"body": body}
        detail = body.get("detail") if isinstance(body, dict) else None
        if r.status_code in (405, 501, 503) or (
            r.status_code == 404 and detail in (None, "Not Found")
        ):
            self.degrade(f"{r.status_code} {detail or r.text[:80]}")
            return None
        err = status_error(r.status_code, body, str(r.request.url))
        if isinstance(err, AuthenticationError) or not quiet:
            raise err
        if r.status_code != 404:
            log.warning("harness_sdk: %s", err)
        elif expect_known:
            tenant = f"cache_salt {self.cache_salt!r}" if self.cache_salt else "no cache_salt"
            msg = (
                f"{method} {path} answered 404 ({detail}): the server does not know trajectory "
                f"{self.trajectory_id!r} in the tenant this trajectory names ({tenant}); "
                "nothing was applied"
            )
            warnings.warn(msg, TrajectoryNotFoundWarning, stacklevel=3)
            log.warning("harness_sdk: %s", msg)
        return None

    async def aclose(self) -> None:
        if self.owns_client:
            await self.client.aclose()

    async def trajectory_state(self) -> dict[str, Any] | None:
        """GET the trajectory on the server (None if unknown or the routes are absent)."""
        return await self.control("GET", f"/trajectories/{self.trajectory_id}")

    async def server_status(self) -> dict[str, Any] | None:
        """GET /agentkv/v1/status (None if the routes are absent)."""
        return await self.control("GET", "/status")

    async def delete_trajectory(self) -> dict[str, Any] | None:
        """DELETE the trajectory (it sent turns: a 404 warns)."""
        return await self.control(
            "DELETE", f"/trajectories/{self.trajectory_id}", expect_known=True
        )

    async def close_trajectory(self, used: bool) -> dict[str, Any] | None:
        """Once per trajectory (idempotent): DELETE it on the server when it ``used`` the server,
        then close the HTTP client if it is ours. The server's release counts, or None."""
        if self.closed:
            return None
        self.closed = True
        try:
            if used:
                return await self.delete_trajectory()
            return None
        finally:
            await self.aclose()


def _json(r: httpx.Response) -> Any:
    try:
        return r.json()
    except ValueError:
        return {"detail": r.text[:500]}


def _loads(data: str) -> Any:
    try:
        return jsonlib.loads(data)
    except ValueError:
        return None


def _normalize_base(url: str) -> str:
    url = url.rstrip("/")
    if url.endswith("/v1"):
        url = url[:-3]
    if not url.startswith(("http://", "https://")):
        raise ConfigError(f"base_url must start with http:// or https://, got {url!r}")
    return url

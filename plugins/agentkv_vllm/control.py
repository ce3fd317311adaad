"""The local control channel between the HTTP routes (API server process) and the
scheduler-side connector (engine core process).

Primitives:
  ControlServer(endpoint, handler)   a ZMQ REP socket served by one daemon thread; each request is
                                     a JSON object ``{"op": ..., ...}``, each reply a JSON object
                                     ``{"status": int, "body": {...}}``; a handler exception becomes
                                     a 500 reply, never a dead engine
  ControlInUse                       a live server already answers on the endpoint: an ipc file
                                     is removed only when no one answers on it (a dead server's)
  ControlClient(endpoint)            REQ client: ``await call(op)`` for the routes,
                                     ``call_sync(op)`` for the /metrics scrape (prometheus_client
                                     collects synchronously); both raise ControlUnavailable when
                                     the engine does not answer in time

JSON, not pickle: the socket is local, but nothing it carries should be able to run code.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio

log = logging.getLogger("agentkv.control")

Handler = Callable[[dict[str, Any]], tuple[int, dict[str, Any]]]


class ControlUnavailable(RuntimeError):
    """The engine-side control channel did not answer."""


class ControlInUse(RuntimeError):
    """Another live server answers on this control endpoint."""


STALE_PROBE_MS = 300


def _prepare_ipc(endpoint: str) -> None:
    """Make room for an ipc socket: a file left by a dead server is removed, but a live server's
    socket is never taken over (its routes would then reach this engine)."""
    if not endpoint.startswith("ipc://"):
        return
    path = Path(endpoint.removeprefix("ipc://"))
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    if not path.exists():
        return
    if _answers(endpoint):
        raise ControlInUse(f"another agentkv engine serves {endpoint}")
    path.unlink(missing_ok=True)


def _answers(endpoint: str) -> bool:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    sock = ctx.socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(endpoint)
        sock.send(_encode("ping", {}))
        return bool(sock.poll(STALE_PROBE_MS, zmq.POLLIN))
    except zmq.ZMQError:
        return False
    finally:
        sock.close(0)


class ControlServer:
    def __init__(self, endpoint: str, handler: Handler) -> None:
        self.endpoint = endpoint
        self._handler = handler
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._stop = threading.Event()
        _prepare_ipc(endpoint)
        self._sock = self._ctx.socket(zmq.REP)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(endpoint)
        if endpoint.startswith("ipc://"):
            os.chmod(endpoint.removeprefix("ipc://"), 0o600)
        self._thread = threading.Thread(target=self._serve, name="agentkv-control", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not dict(poller.poll(200)):
                continue
            raw = self._sock.recv()
            try:
                request = json.loads(raw)
                if not isinstance(request, dict):
                    raise ValueError("request must be a JSON object")
                status, body = self._handler(request)
            except Exception as exc:
                log.exception("agentkv control request failed")
                status, body = 500, {"detail": f"{type(exc).__name__}: {exc}"}
            self._sock.send(json.dumps({"status": status, "body": body}, default=str).encode())

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self._sock.close(0)
        if self.endpoint.startswith("ipc://"):
            Path(self.endpoint.removeprefix("ipc://")).unlink(missing_ok=True)


class ControlClient:
    """One REQ socket per call: REQ sockets are strict send/recv pairs, and a timed-out call must
    not poison the next one."""

    def __init__(self, endpoint: str, timeout_s: float = 10.0) -> None:
        self.endpoint = endpoint
        self.timeout_ms = int(timeout_s * 1000)
        self._ctx = zmq.asyncio.Context.instance()

    async def call(self, op: str, **fields: Any) -> tuple[int, dict[str, Any]]:
        sock = self._ctx.socket(zmq.REQ)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.endpoint)
        try:
            await sock.send(_encode(op, fields))
            if not await sock.poll(self.timeout_ms, zmq.POLLIN):  # type: ignore[call-arg]
                raise self._unavailable()
            return _decode(await sock.recv())
        finally:
            sock.close(0)

    def call_sync(
        self, op: str, timeout_s: float | None = None, **fields: Any
    ) -> tuple[int, dict[str, Any]]:
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        sock = ctx.socket(zmq.REQ)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.endpoint)
        timeout_ms = self.timeout_ms if timeout_s is None else int(timeout_s * 1000)
        try:
            sock.send(_encode(op, fields))
            if not sock.poll(timeout_ms, zmq.POLLIN):
                raise self._unavailable()
            return _decode(sock.recv())
        finally:
            sock.close(0)

    def _unavailable(self) -> ControlUnavailable:
        return ControlUnavailable(f"agentkv engine control channel {self.endpoint} did not answer")


def _encode(op: str, fields: dict[str, Any]) -> bytes:
    return json.dumps({"op": op, **fields}).encode()


def _decode(raw: bytes) -> tuple[int, dict[str, Any]]:
    reply = json.loads(raw)
    return int(reply["status"]), dict(reply["body"])

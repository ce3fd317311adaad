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
                                     the engine does not answer in time. Its sockets are pooled
                                     and reused; one whose call did not end in a reply is closed

JSON, not pickle: the socket is local, but nothing it carries should be able to run code.
"""

from __future__ import annotations

import asyncio
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
        while not self._stop.is_set():
            if not self._sock.poll(200, zmq.POLLIN):
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


# Idle REQ sockets a client keeps for reuse; more concurrent calls open more, closed after use.
POOL_MAX = 8


class ControlClient:
    """REQ sockets kept across calls (a pool): opening one per call cost a connect, a new peer on
    the engine's REP socket and zmq I/O-thread work on both sides, every pump tick. A REQ socket
    is a strict send/recv pair, so a socket goes back to the pool only after its reply was read:
    a call that times out, is cancelled or fails closes its socket, and a late reply dies with
    it instead of answering the next call. The sync pool is locked (``call_sync`` runs on
    whatever thread scrapes /metrics); the async pool belongs to one event loop."""

    def __init__(self, endpoint: str, timeout_s: float = 10.0) -> None:
        self.endpoint = endpoint
        self.timeout_ms = int(timeout_s * 1000)
        self._ctx = zmq.asyncio.Context.instance()
        self._sync_ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._free: list[zmq.asyncio.Socket] = []
        self._free_loop: asyncio.AbstractEventLoop | None = None
        self._sync_free: list[zmq.Socket[bytes]] = []
        self._sync_lock = threading.Lock()
        self.opened = 0  # sockets opened over the client's life (a reuse counts none)

    async def call(self, op: str, **fields: Any) -> tuple[int, dict[str, Any]]:
        sock = self._take_async()
        try:
            await sock.send(_encode(op, fields))
            if not await sock.poll(self.timeout_ms, zmq.POLLIN):  # type: ignore[call-arg]
                raise self._unavailable()
            reply = _decode(await sock.recv())
        except BaseException:
            sock.close(0)
            raise
        self._give_async(sock)
        return reply

    def call_sync(
        self, op: str, timeout_s: float | None = None, **fields: Any
    ) -> tuple[int, dict[str, Any]]:
        timeout_ms = self.timeout_ms if timeout_s is None else int(timeout_s * 1000)
        sock = self._take_sync()
        try:
            sock.send(_encode(op, fields))
            if not sock.poll(timeout_ms, zmq.POLLIN):
                raise self._unavailable()
            reply = _decode(sock.recv())
        except BaseException:
            sock.close(0)
            raise
        with self._sync_lock:
            if len(self._sync_free) < POOL_MAX:
                self._sync_free.append(sock)
                return reply
        sock.close(0)
        return reply

    def close(self) -> None:
        """Close the idle sockets (calls in flight close theirs when they end)."""
        with self._sync_lock:
            socks: list[Any] = [*self._sync_free, *self._free]
            self._sync_free, self._free = [], []
        for sock in socks:
            sock.close(0)

    def _take_async(self) -> zmq.asyncio.Socket:
        loop = asyncio.get_running_loop()
        if loop is not self._free_loop:
            # An asyncio socket polls through its loop: one made on another (closed) loop
            # is not reused.
            for stale in self._free:
                stale.close(0)
            self._free, self._free_loop = [], loop
        if self._free:
            return self._free.pop()
        sock = self._ctx.socket(zmq.REQ)
        return self._opened(sock)

    def _give_async(self, sock: zmq.asyncio.Socket) -> None:
        if len(self._free) < POOL_MAX:
            self._free.append(sock)
        else:
            sock.close(0)

    def _take_sync(self) -> zmq.Socket[bytes]:
        with self._sync_lock:
            if self._sync_free:
                return self._sync_free.pop()
            sock = self._sync_ctx.socket(zmq.REQ)
            return self._opened(sock)

    def _opened(self, sock: Any) -> Any:
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.endpoint)
        self.opened += 1
        return sock

    def _unavailable(self) -> ControlUnavailable:
        return ControlUnavailable(f"agentkv engine control channel {self.endpoint} did not answer")


def _encode(op: str, fields: dict[str, Any]) -> bytes:
    return json.dumps({"op": op, **fields}).encode()


def _decode(raw: bytes) -> tuple[int, dict[str, Any]]:
    reply = json.loads(raw)
    return int(reply["status"]), dict(reply["body"])

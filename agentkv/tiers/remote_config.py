"""Where and how to reach the remote tier (remote.py's client reads it).

Primitives:
    RemoteConfig            ``RemoteConfig.parse(url, **options)`` takes ``valkey://``,
                            ``valkeys://`` (TLS), ``redis://``, ``rediss://`` (TLS) URLs with
                            optional user, password, port, db and query options; a bad part raises
                            ConfigError naming it. Frozen; its repr never shows the password.
    SCHEMES, DEFAULT_PORT   URL scheme -> TLS; the port when the URL names none.
"""

from __future__ import annotations

import math
import os
import re
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from agentkv.errors import ConfigError
from agentkv.tiers.remote_auth import SECRET_ENV

SCHEMES = {"valkey": False, "redis": False, "valkeys": True, "rediss": True}
"""URL scheme -> TLS."""
DEFAULT_PORT = 6379
_PREFIX_RE = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")
_MAX_TTL_S = 365 * 86400.0


@dataclass(frozen=True, slots=True)
class RemoteConfig:
    """How to reach the remote tier. Build it with ``parse`` (validates every field)."""

    host: str
    port: int = DEFAULT_PORT
    db: int = 0
    tls: bool = False
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    password_env: str | None = None
    """Name of an environment variable holding the password (read when the client is built)."""
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_check_hostname: bool = True
    """Check that the server certificate names the host of the URL (an IP needs an IP SAN)."""
    key_prefix: str = "agentkv"
    auth_key: str | None = field(default=None, repr=False)
    """The deployment secret that names and signs blocks (remote_auth); None: the
    ``AGENTKV_REMOTE_KEY`` environment variable, else unauthenticated."""
    ttl_s: float = 3600.0
    connect_timeout_s: float = 2.0
    op_timeout_s: float = 5.0
    max_batch_bytes: int = 16 << 20
    backoff_s: float = 2.0

    # Options a URL query may carry (``?ttl_s=600&key_prefix=prod``).
    _QUERY = (
        "password_env",
        "tls_ca",
        "tls_cert",
        "tls_key",
        "tls_check_hostname",
        "key_prefix",
        "ttl_s",
        "connect_timeout_s",
        "op_timeout_s",
        "max_batch_bytes",
        "backoff_s",
    )

    @classmethod
    def parse(cls, url: str, **options: Any) -> RemoteConfig:
        """Return the config for ``url`` plus ``options`` (any field name; they override the URL).

        URL grammar: ``scheme://[[user]:password@]host[:port][/db][?option=value&...]`` with scheme
        valkey, redis (plain) or valkeys, rediss (TLS); port defaults to 6379, db to 0; query
        options are the field names listed in ``_QUERY``. The password may come from the URL
        (percent-encoded), ``password=`` or ``password_env=`` (an environment variable's name).
        Raises ConfigError with the offending part for anything invalid, including a
        ``password_env`` variable that is not set.
        """
        if not isinstance(url, str) or "://" not in url:
            raise ConfigError(
                f"remote URL {url if not isinstance(url, str) else _redact(url)!r} must look like "
                "valkey://host:port/0 "
                "(schemes: valkey, valkeys, redis, rediss)"
            )
        try:
            parts = urllib.parse.urlsplit(url)
            port = parts.port
        except ValueError as exc:
            raise ConfigError(f"remote URL {_redact(url)!r}: {exc}") from exc
        scheme = parts.scheme.lower()
        if scheme not in SCHEMES:
            raise ConfigError(
                f"remote URL scheme {scheme!r} is not supported "
                "(use valkey://, valkeys://, redis:// or rediss://)"
            )
        if not parts.hostname:
            raise ConfigError(f"remote URL {_redact(url)!r} has no host")
        path = parts.path.strip("/")
        if path and not path.isdigit():
            raise ConfigError(f"remote URL database {path!r} must be a number (as in /0)")
        if parts.fragment:
            raise ConfigError("remote URL must not have a #fragment")
        fields: dict[str, Any] = {
            "host": parts.hostname,
            "port": port if port is not None else DEFAULT_PORT,
            "db": int(path) if path else 0,
            "tls": SCHEMES[scheme],
            "username": urllib.parse.unquote(parts.username) if parts.username else None,
            "password": urllib.parse.unquote(parts.password) if parts.password else None,
        }
        for name, values in urllib.parse.parse_qs(parts.query, keep_blank_values=True).items():
            if name not in cls._QUERY:
                raise ConfigError(
                    f"remote URL option {name!r} is unknown (known: {', '.join(cls._QUERY)})"
                )
            if len(values) != 1:
                raise ConfigError(f"remote URL option {name!r} is given more than once")
            fields[name] = values[0]
        known = {f for f in cls.__dataclass_fields__ if not f.startswith("_")}
        for name, value in options.items():
            if name not in known:
                raise ConfigError(f"unknown remote tier option {name!r}")
            if value is not None:
                fields[name] = value
        config = cls(**_coerce(fields))
        config.validate()
        return config

    from_url = parse

    def validate(self) -> None:
        """Raise ConfigError naming the first invalid field."""
        if not 0 < self.port < 65536:
            raise ConfigError(f"remote port {self.port} is out of range")
        if self.db < 0:
            raise ConfigError(f"remote database {self.db} must not be negative")
        if not _PREFIX_RE.match(self.key_prefix):
            raise ConfigError(
                f"remote key_prefix {self.key_prefix!r} must be 1-64 characters of "
                "letters, digits, '_', '.', ':' or '-'"
            )
        for name in ("ttl_s", "connect_timeout_s", "op_timeout_s"):
            value = getattr(self, name)
            if not (value > 0 and math.isfinite(value)):
                raise ConfigError(f"remote {name} must be positive and finite, got {value}")
        if self.ttl_s > _MAX_TTL_S:
            raise ConfigError(f"remote ttl_s {self.ttl_s} is above {_MAX_TTL_S:.0f} s (a year)")
        if not (self.backoff_s >= 0 and math.isfinite(self.backoff_s)):
            raise ConfigError(f"remote backoff_s must not be negative, got {self.backoff_s}")
        if self.max_batch_bytes <= 0:
            raise ConfigError(
                f"remote max_batch_bytes must be positive, got {self.max_batch_bytes}"
            )
        if (self.tls_ca or self.tls_cert or self.tls_key) and not self.tls:
            raise ConfigError("remote TLS files need a TLS URL (valkeys:// or rediss://)")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ConfigError("remote tls_cert and tls_key go together (client certificate)")
        for name in ("tls_ca", "tls_cert", "tls_key"):
            path = getattr(self, name)
            if path and not os.path.isfile(path):
                raise ConfigError(f"remote {name} {path!r} is not a readable file")
        self.resolved_password()

    def resolved_password(self) -> str | None:
        """The password: ``password``, else the ``password_env`` variable. ConfigError when unset."""
        if self.password is not None:
            return self.password
        if self.password_env:
            value = os.environ.get(self.password_env)
            if value is None:
                raise ConfigError(
                    f"remote password variable {self.password_env} is not set in the environment"
                )
            return value
        return None

    def resolved_auth_key(self) -> str | None:
        """The deployment secret: ``auth_key``, else the ``AGENTKV_REMOTE_KEY`` variable."""
        return self.auth_key or os.environ.get(SECRET_ENV) or None

    @property
    def url(self) -> str:
        """The server URL without credentials or options (safe to log)."""
        scheme = "valkeys" if self.tls else "valkey"
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{scheme}://{host}:{self.port}/{self.db}"


def _coerce(fields: dict[str, Any]) -> dict[str, Any]:
    """Convert query strings to field types; ConfigError names the field."""
    converters: dict[str, Callable[[Any], Any]] = {
        "port": int,
        "db": int,
        "ttl_s": float,
        "connect_timeout_s": float,
        "op_timeout_s": float,
        "backoff_s": float,
        "max_batch_bytes": int,
    }
    out = dict(fields)
    flag = out.get("tls_check_hostname")
    if isinstance(flag, str):
        if flag.lower() not in ("1", "0", "true", "false", "yes", "no"):
            raise ConfigError(f"remote tls_check_hostname {flag!r} must be true or false")
        out["tls_check_hostname"] = flag.lower() in ("1", "true", "yes")
    for name, convert in converters.items():
        if name in out and isinstance(out[name], str):
            try:
                out[name] = convert(out[name])
            except ValueError as exc:
                raise ConfigError(f"remote {name} {out[name]!r} is not a number") from exc
    return out


def _redact(url: str) -> str:
    return re.sub(r"//([^/@]*):[^/@]*@", r"//\1:***@", url)

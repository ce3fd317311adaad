"""The one grammar of trajectory ids and branch names, shared by the request params, the routes
and the SDK.

An id (``trajectory_id`` or ``branch``) is 1 to 256 characters from ``A-Z a-z 0-9 . _ : @ -``
(ASCII only), and is not ``.`` or ``..``. Every id that a request's
``kv_transfer_params.agentkv`` accepts is therefore usable, unencoded, as the ``{id}`` path
segment of ``/agentkv/v1/trajectories/{id}/...``:

- no ``/``: a slash splits the path, so the route would not match (404 from routing, before any
  handler could name the problem);
- no whitespace, ``%``, ``?``, ``#`` or non-ASCII: they need percent-encoding, which clients and
  proxies do not agree on;
- not ``.`` or ``..``: HTTP clients (httpx, curl, browsers) remove dot segments, so
  ``trajectories/../pause`` is sent as ``/agentkv/v1/pause``.

``:`` and ``@`` are plain path characters (RFC 3986 ``pchar``) and need no encoding.

Primitives:
  ID_PATTERN        the grammar as an anchored regex without look-around (Python ``re``, the Rust
                    regex pydantic uses, JSON Schema)
  MAX_ID_LEN        256
  validate_id(value, what="trajectory_id") -> value, or InvalidIdError naming the problem
  is_valid_id(value) -> bool
  InvalidIdError    a ConfigError (a ValueError)
  TENANT_FIELD, TENANT_HEADER   ``cache_salt`` (a request's and a control body's field) and
                    ``X-AgentKV-Cache-Salt`` (the control routes' header): a trajectory's tenant

No third-party imports: the plugin and the SDK both import this module.
"""

from __future__ import annotations

import re

from agentkv.errors import ConfigError

MAX_ID_LEN = 256
ID_CHARS = "A-Za-z0-9._:@-"
"""The allowed characters, as the body of a regex character class."""
ALLOWED_DESCRIPTION = f"1-{MAX_ID_LEN} characters from A-Z a-z 0-9 . _ : @ -, not '.' or '..'"

# "Not '.' or '..'" without look-around: the first character is not a dot; or a dot then a
# non-dot; or two dots then at least one more character.
_NON_DOT = "A-Za-z0-9_:@-"
ID_PATTERN = (
    rf"^(?:[{_NON_DOT}][{ID_CHARS}]{{0,{MAX_ID_LEN - 1}}}"
    rf"|\.[{_NON_DOT}][{ID_CHARS}]{{0,{MAX_ID_LEN - 2}}}"
    rf"|\.\.[{ID_CHARS}]{{1,{MAX_ID_LEN - 2}}})$"
)
_ID_RE = re.compile(ID_PATTERN)

# A trajectory's tenant is its requests' cache_salt (vLLM's per-request salt): the control routes
# take it from this header or this body field (routers drop unknown headers), the SDK sends both.
TENANT_FIELD = "cache_salt"
TENANT_HEADER = "X-AgentKV-Cache-Salt"
_CHAR_RE = re.compile(f"[{ID_CHARS}]")


class InvalidIdError(ConfigError):
    """A trajectory id or branch name is outside the id grammar (see ``agentkv.ids``)."""


def _problem(value: object) -> str | None:
    if not isinstance(value, str):
        return f"must be a string, got {type(value).__name__}"
    if not value:
        return "must not be empty"
    if len(value) > MAX_ID_LEN:
        return f"is {len(value)} characters long; the limit is {MAX_ID_LEN}"
    for i, ch in enumerate(value):
        if not _CHAR_RE.fullmatch(ch):
            return f"has the character {ch!r} at position {i}, which is not allowed"
    if value in (".", ".."):
        return "must not be '.' or '..' (HTTP clients drop such path segments)"
    if not _ID_RE.fullmatch(value):  # pragma: no cover - the checks above cover the grammar
        return "does not match the id grammar"
    return None


def validate_id(value: object, what: str = "trajectory_id") -> str:
    """Return ``value`` when it is a valid id; else raise InvalidIdError naming the problem."""
    problem = _problem(value)
    if problem is not None:
        shown = repr(value)
        if isinstance(value, str) and len(value) > 64:
            shown = repr(value[:64]) + "..."
        raise InvalidIdError(f"{what} {shown} {problem}; allowed: {ALLOWED_DESCRIPTION}")
    assert isinstance(value, str)
    return value


def is_valid_id(value: object) -> bool:
    """True when ``value`` is a string in the id grammar."""
    return isinstance(value, str) and _ID_RE.fullmatch(value) is not None


__all__ = [
    "ALLOWED_DESCRIPTION",
    "ID_CHARS",
    "ID_PATTERN",
    "MAX_ID_LEN",
    "InvalidIdError",
    "is_valid_id",
    "validate_id",
]

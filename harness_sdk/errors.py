"""The harness_sdk exception tree (httpx style: one base, categorized leaves) and its warnings.

HarnessError
├── ConfigError            a constructor argument is invalid (also a ValueError)
│   ├── LayoutError        a zone or context operation is invalid
│   └── InvalidIdError     a trajectory id or branch outside the id grammar of ``agentkv.ids``
│                          (also ``agentkv.ids.InvalidIdError``)
├── TrajectoryClosedError  the trajectory or branch was closed, pruned or joined
├── TransportError         the server could not be reached (wraps httpx.TransportError)
│   └── TimeoutError_      the request timed out (also the builtin TimeoutError)
└── HTTPStatusError        the server answered 4xx/5xx; ``.status_code``, ``.body``
    ├── BadRequestError        400 / 422
    ├── AuthenticationError    401 / 403
    ├── NotFoundError          404
    ├── RateLimitError         429
    └── ServerError            5xx

HarnessWarning (UserWarning)
├── StableZoneChangedWarning   a stable zone (system, tools, memory) changed between turns
├── VolatileContentWarning     volatile data (timestamp, UUID, request id) in a stable zone
├── DegradedWarning            the server lacks the agentkv routes; pause/resume are skipped
├── PauseNotAppliedWarning     the engine answered a pause with ``applied: false`` (once per
│                              trajectory)
└── TrajectoryNotFoundWarning  a pause, resume or DELETE the SDK expected to apply answered 404:
                               the server does not know the trajectory in its tenant
"""

from __future__ import annotations

from typing import Any

from agentkv import ids as _ids


class HarnessError(Exception):
    """Base of every error harness_sdk raises on purpose."""


class ConfigError(HarnessError, ValueError):
    """A constructor argument (id, URL, option) is invalid."""


class LayoutError(ConfigError):
    """A zone or context operation is invalid (unknown zone, bad message, bad fork count)."""


class InvalidIdError(ConfigError, _ids.InvalidIdError):
    """A trajectory id or branch name is outside the id grammar (``agentkv.ids``): it would be
    rejected by the server's params and could not be used in the agentkv routes."""


class TrajectoryClosedError(HarnessError):
    """The trajectory or branch was closed, pruned or joined and takes no more turns."""


class TransportError(HarnessError):
    """The server could not be reached or the connection failed."""


class TimeoutError_(TransportError, TimeoutError):
    """The request timed out."""


class HTTPStatusError(HarnessError):
    """The server answered with an error status."""

    def __init__(self, message: str, *, status_code: int, body: Any = None, url: str = "") -> None:
        super().__init__(message)
        self.status_code = status_code
        self.body = body
        self.url = url


class BadRequestError(HTTPStatusError):
    """400 or 422: the request was rejected as invalid."""


class AuthenticationError(HTTPStatusError):
    """401 or 403: missing or wrong API key."""


class NotFoundError(HTTPStatusError):
    """404: unknown route, model or trajectory."""


class RateLimitError(HTTPStatusError):
    """429: too many requests."""


class ServerError(HTTPStatusError):
    """5xx: the server failed."""


def status_error(status_code: int, body: Any, url: str) -> HTTPStatusError:
    """The HTTPStatusError subclass for ``status_code``, with the server's detail in the message."""
    detail: Any = body
    if isinstance(body, dict):
        detail = body.get("detail") or body.get("error") or body.get("message") or body
        if isinstance(detail, dict):
            detail = detail.get("message", detail)
    cls: type[HTTPStatusError] = HTTPStatusError
    if status_code in (400, 422):
        cls = BadRequestError
    elif status_code in (401, 403):
        cls = AuthenticationError
    elif status_code == 404:
        cls = NotFoundError
    elif status_code == 429:
        cls = RateLimitError
    elif status_code >= 500:
        cls = ServerError
    return cls(f"{status_code} from {url}: {detail}", status_code=status_code, body=body, url=url)


class HarnessWarning(UserWarning):
    """Base of harness_sdk's warnings."""


class StableZoneChangedWarning(HarnessWarning):
    """A stable zone changed between turns: the prefix cache breaks there."""


class VolatileContentWarning(HarnessWarning):
    """Volatile data (timestamps, UUIDs, request ids) sits in a stable zone."""


class DegradedWarning(HarnessWarning):
    """The server has no agentkv routes: pause/resume/close are skipped, turns still work."""


class PauseNotAppliedWarning(HarnessWarning):
    """The engine answered a pause with ``applied: false``: its decision did not take effect
    (yet); the reply's ``state`` says where the trajectory's branch was. Warned once per
    trajectory."""


class TrajectoryNotFoundWarning(HarnessWarning):
    """A pause, resume or DELETE of a trajectory that sent turns answered 404: the server does
    not know it in the tenant the SDK named (another ``cache_salt`` than its turns', an
    ``idle_ttl_s`` expiry, a restart); nothing was applied."""

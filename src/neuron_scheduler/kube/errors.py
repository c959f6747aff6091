"""The Kubernetes API's errors, typed: callers write `except NotFound`, never `status == 404`.

`API_ERRORS` is what a failed call can raise: the server answered with an error, or could not be
reached at all (connection, TLS, timeout).
"""

from __future__ import annotations

import aiohttp
import msgspec
from aiohttp.http_exceptions import HttpProcessingError


class ApiError(Exception):
    """The API server answered with an HTTP error status."""

    status = 0  # set per instance; subclasses name the statuses callers act on

    def __init__(self, method: str, path: str, status: int, body: bytes) -> None:
        self.status = status
        self.reason = ""
        message = body.decode(errors="replace")[:500]
        try:
            status_object = msgspec.json.decode(body)
            if isinstance(status_object, dict):
                message = str(status_object.get("message", message))
                self.reason = str(status_object.get("reason", ""))
        except msgspec.DecodeError:
            pass
        self.message = message
        super().__init__(f"{method} {path}: HTTP {status}: {message}")


class Forbidden(ApiError):
    """403: the caller's RBAC does not allow the request."""


class NotFound(ApiError):
    """404: the object does not exist (or no longer does)."""


class Conflict(ApiError):
    """409: a precondition (uid, resourceVersion) failed or the object already exists."""


class TooManyRequests(ApiError):
    """429: for an eviction, a PodDisruptionBudget that allows no disruption now (or the API
    server's own rate limit)."""


class Gone(ApiError):
    """410: the resourceVersion a watch or list asked for has been compacted away."""


class TooLarge(ApiError):
    """The answer's body is over the size we read (a list page of hostile objects, a broken
    proxy): refused whole rather than held in memory."""

    def __init__(self, method: str, path: str, limit: int) -> None:
        super().__init__(method, path, 0, f"answer larger than {limit} bytes".encode())


_BY_STATUS: dict[int, type[ApiError]] = {
    403: Forbidden,
    404: NotFound,
    409: Conflict,
    410: Gone,
    429: TooManyRequests,
}


def api_error(method: str, path: str, status: int, body: bytes) -> ApiError:
    """The typed error for an HTTP error answer."""
    return _BY_STATUS.get(status, ApiError)(method, path, status, body)


API_ERRORS: tuple[type[BaseException], ...] = (
    ApiError,
    aiohttp.ClientError,
    # A malformed answer or one line over the limit (aiohttp's LineTooLong is no ClientError).
    HttpProcessingError,
    TimeoutError,
    OSError,
)


# A call that failed, or whose answer could not be decoded as the object asked for.
READ_ERRORS: tuple[type[BaseException], ...] = (*API_ERRORS, msgspec.DecodeError)


def error_text(error: BaseException) -> str:
    """One line for a person: the API server's own message when it sent one."""
    if isinstance(error, ApiError):
        return error.message
    return str(error) or type(error).__name__

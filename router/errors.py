"""The OpenAI error envelope: `{"error": {"message", "type", "param", "code"}}`.

Every non-2xx answer of the router goes through `APIError`, so clients (the official `openai`
package included) always see the same shape, and a client's mistake is never a 500.
"""

from __future__ import annotations

from typing import Any

import msgspec
from starlette.responses import Response

# HTTP status -> the OpenAI `type` used when the raiser names none.
_DEFAULT_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    502: "server_error",
    503: "service_unavailable",
    504: "timeout_error",
}


class APIError(Exception):
    """A request that ends with an OpenAI-shaped error; `status` is the HTTP status code."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str | None = None,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or _DEFAULT_TYPES.get(status, "invalid_request_error")
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        """The envelope, also used as the `error` object of an SSE chunk."""
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> Response:
        return Response(
            msgspec.json.encode(self.body()),
            status_code=self.status,
            headers=self.headers,
            media_type="application/json",
        )


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def unavailable(message: str) -> APIError:
    return APIError(503, message, code="no_workers")

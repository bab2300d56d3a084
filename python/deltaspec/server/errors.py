"""Errors a request can meet, as OpenAI-shaped JSON bodies with an HTTP status.

Clients (the `openai` package, llama-server's users) read `error.message`, `error.type`,
`error.param` and `error.code`; every refusal names the parameter at fault where there is one.
"""

from __future__ import annotations

from typing import Any


class APIError(Exception):
    """A request the server answers with `status` and an error body instead of a completion."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def anthropic_body(self) -> dict[str, Any]:
        """The error as Anthropic's Messages API writes it (its `type` names the class of error; the
        parameter at fault, if any, is named in the message, which says which field it is)."""
        kind = _ANTHROPIC_TYPES.get(self.status, "api_error" if self.status >= 500 else "invalid_request_error")
        return {"type": "error", "error": {"type": kind, "message": self.message}}


_TYPES = {401: "authentication_error", 404: "not_found_error", 429: "rate_limit_error",
          503: "server_unavailable"}
# Anthropic's error types by status (its 529 "overloaded_error" is our 503: no slot or shutting down)
_ANTHROPIC_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
                    413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


class QueueFull(APIError):
    """Every slot is busy and the waiting queue is at its bound: retry later."""

    def __init__(self, limit: int):
        super().__init__(429, f"the server is busy: {limit} requests already wait for a free slot; retry later",
                         code="queue_full")


class ShuttingDown(APIError):
    def __init__(self) -> None:
        super().__init__(503, "the server is shutting down and takes no new requests", code="shutting_down")

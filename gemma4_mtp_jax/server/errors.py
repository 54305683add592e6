"""OpenAI-style API errors: every refusal the server makes is one of these, with a JSON body clients can read."""

from __future__ import annotations

import json
import re
from typing import Any

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
}


class APIError(Exception):
    """An error answered to the client as `{"error": {"message", "type", "param", "code"}}` with `status`."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
        self.headers = headers or {}

    def __reduce__(self):  # raised in the worker processes that prepare large requests (prepare.py)
        return _api_error, (self.status, self.message, self.param, self.code, self.type, self.headers)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _api_error(status: int, message: str, param: str | None, code: str | None, type: str,
               headers: dict[str, str]) -> APIError:
    return APIError(status, message, param=param, code=code, type=type, headers=headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


_SURROGATE = re.compile("[\\ud800-\\udfff]")


def json_bytes(obj: Any) -> bytes:
    """Compact UTF-8 JSON, for every body the server sends. A lone surrogate (a client can send one as "\\ud800",
    and an error may echo it) has no UTF-8 form: it becomes U+FFFD."""
    text = json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:
        return _SURROGATE.sub("\ufffd", text).encode("utf-8")

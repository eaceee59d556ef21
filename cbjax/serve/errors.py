"""The server's one error type: OpenAI's error body with an HTTP status, raised by every check."""

from __future__ import annotations


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, type: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.headers = headers or {}
        self.status = status
        self.message = message
        self.param = param
        self.type = type or _ERROR_TYPES.get(status, "invalid_request_error")
        self.code = code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


_ERROR_TYPES = {404: "not_found_error", 429: "rate_limit_error", 503: "service_unavailable",
                500: "internal_server_error"}


def bad(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


def utf8(text: str, param: str) -> str:
    """Text the tokenizer can take: JSON may carry a lone surrogate (\\ud800), which no UTF-8
    encoder accepts."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise bad(f"'{param}' is not valid Unicode: {e.reason} at character {e.start}", param) from None
    return text


def check_keys(value: dict, allowed, path: str) -> None:
    """Refuse (400, naming `path.key`) a key of the object at `path` that the server does not read:
    strict at every level, as at the top (a silently dropped field would change what a client
    measures without telling it)."""
    for key in value:
        if key not in allowed:
            raise bad(f"'{path}.{key}' is not a field this server honours ({', '.join(sorted(allowed))})",
                      f"{path}.{key}")

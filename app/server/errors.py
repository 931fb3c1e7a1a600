"""OpenAI's error shape: {"error": {"message", "type", "param", "code"}} with the matching status."""

from __future__ import annotations

from pydantic import ValidationError
from starlette.responses import JSONResponse

TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
         405: "invalid_request_error", 408: "invalid_request_error", 413: "invalid_request_error",
         415: "invalid_request_error", 429: "rate_limit_error",
         500: "server_error", 503: "service_unavailable"}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers


class FieldError(ValueError):
    """A body's problem that a check of the whole body finds (pydantic gives such errors no location): it names the
    field for the error's `param`."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    """The JSON of an error, as an answer or as a stream's last event."""
    return {"error": {"message": message, "type": TYPES.get(status, "invalid_request_error"), "param": param,
                      "code": code}}


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status, headers=headers)


def from_api_error(error: APIError) -> JSONResponse:
    return error_response(error.status, error.message, error.param, error.code, error.headers)


def from_validation_error(error: ValidationError) -> APIError:
    """The first problem of a request body, with its JSON path as `param`."""
    first = error.errors()[0]
    param = ".".join(str(p) for p in first["loc"] if not _is_type_tag(p))
    message = first["msg"].removeprefix("Value error, ")
    cause = (first.get("ctx") or {}).get("error")
    if isinstance(cause, FieldError):  # (its message names the field already)
        param = ".".join(filter(None, (param, cause.param)))
        return APIError(400, message, param, "invalid_value")
    return APIError(400, f"{param}: {message}" if param else message, param or None, "invalid_value")


def _is_type_tag(part) -> bool:
    """pydantic puts union branch names ("str", "list[int]", "function-after[...]") into error locations."""
    text = str(part)
    return not isinstance(part, int) and ("[" in text or text in ("str", "int", "float", "bool", "dict", "list",
                                                                  "none", "tagged-union"))

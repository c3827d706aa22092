"""OpenAI-style errors: `{"error": {"message", "type", "param", "code"}}` with the matching status.

Every way a request can be refused ends here, including FastAPI's own body validation (a 422 by
default, a 400 here as OpenAI answers) and malformed JSON, so clients see one error shape. An exception
nothing here handles is answered (500, same shape) by `response_counter`, which also counts it.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from iterserve.server.errors import InvalidRequestError

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 405: "invalid_request_error", 408: "invalid_request_error",
          413: "invalid_request_error",
          429: "rate_limit_error", 500: "internal_error", 503: "service_unavailable"}

# pydantic names union branches in an error's location (('prompt', 'str'), ...); they are not fields
_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "function-after", "function-before"}


class APIError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": _printable(message), "type": _TYPES.get(status, "invalid_request_error"),
                      "param": None if param is None else _printable(param), "code": code}}


def _printable(text: str) -> str:
    # a message or field name can quote the client's input, lone surrogates included, which UTF-8
    # (the response's encoding) cannot carry
    return text if text.isascii() else text.encode("utf-8", "backslashreplace").decode("utf-8")


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status, headers=headers)


def from_invalid_request(e: InvalidRequestError) -> APIError:
    return APIError(400, str(e), param=e.param, code="invalid_value")


def validation_param(loc: tuple) -> str | None:
    """('body', 'messages', 0, 'role') -> 'messages[0].role'."""
    parts: list[str] = []
    for item in loc:
        if item == "body" and not parts:
            continue
        if isinstance(item, int):
            parts.append(f"[{item}]")
        elif item in _TYPE_TAGS or "[" in str(item):
            continue
        else:
            parts.append(("." if parts else "") + str(item))
    return "".join(parts) or None


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return error_response(exc.status, exc.message, exc.param, exc.code, exc.headers)

    @app.exception_handler(InvalidRequestError)
    async def _invalid(request: Request, exc: InvalidRequestError):
        return error_response(400, str(exc), exc.param, "invalid_value")

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        errors = exc.errors()
        first = errors[0] if errors else {}
        param = validation_param(tuple(first.get("loc", ())))
        if first.get("type") == "json_invalid":
            message, param = f"the body is not valid JSON: {first.get('ctx', {}).get('error', '')}", None
        elif param is None:
            message = f"the request body must be a JSON object ({first.get('msg', 'invalid body')})"
            if "json" not in request.headers.get("content-type", "json"):
                message += "; send it with Content-Type: application/json"
        else:
            message = f"{param}: {first.get('msg', 'invalid value')}"
            if len(errors) > 1:
                message += f" (and {len(errors) - 1} more error{'s' if len(errors) > 2 else ''})"
        return error_response(400, message, param, "invalid_value")

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        # FastAPI raises these for bodies it cannot decode (e.g. invalid UTF-8), 404 routes, 405 methods
        return error_response(exc.status_code, str(exc.detail), None, None, getattr(exc, "headers", None))

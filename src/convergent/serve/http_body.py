"""Reading a request body under ``serve.http.max_request_bytes``, before anything parses or
tokenizes it (the instance API and the dispatcher share the rule).

A ``Content-Length`` over the limit is refused before a byte is read; a body sent without
one (chunked) is read until it passes the limit. The answer is a 413 with an OpenAI-style
error body naming the setting.
"""

from __future__ import annotations

from fastapi import Request as HTTPRequest

__all__ = ["BodyTooLarge", "read_body", "too_large"]


class BodyTooLarge(Exception):
    """The body is larger than ``limit`` bytes."""

    def __init__(self, limit: int) -> None:
        super().__init__(limit)
        self.limit = limit


async def read_body(request: HTTPRequest, limit: int) -> bytes:
    """The whole body, or :class:`BodyTooLarge` once it is known to pass ``limit`` bytes."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise BodyTooLarge(limit)
    chunks, n = [], 0
    async for chunk in request.stream():
        n += len(chunk)
        if n > limit:
            raise BodyTooLarge(limit)
        chunks.append(chunk)
    return b"".join(chunks)


def too_large(limit: int, param: str | None):
    """The 413 of a body over ``limit`` bytes (``param``: the field that makes it large)."""
    from fastapi.responses import JSONResponse

    message = (
        f"request body is larger than serve.http.max_request_bytes={limit} bytes "
        f"(shorten the {param or 'request'})"
    )
    return JSONResponse(
        status_code=413,
        content={
            "error": {
                "message": message,
                "type": "invalid_request_error",
                "param": param,
                "code": "request_too_large",
            }
        },
    )

"""JSON in and out of the routes: a request's raw JSON body (its Content-Type checked) and a
response carrying one pydantic body."""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel

from server.errors import invalid_request


async def json_body(request: Request) -> bytes:
    """The raw body, once its Content-Type says JSON (a body without one is taken as JSON)."""
    content_type = request.headers.get("content-type")
    if content_type is not None and not _is_json(content_type):
        message = f"Content-Type must be application/json, got {content_type!r}."
        raise invalid_request(message, code="invalid_content_type")
    return await request.body()


def json_response(body: BaseModel, status: int = 200, *, exclude_none: bool = False) -> Response:
    """`body` serialized as the response (`exclude_none`: absent fields left out, not null)."""
    content = body.model_dump_json(exclude_none=exclude_none)
    return Response(content, status_code=status, media_type="application/json")


def _is_json(content_type: str) -> bool:
    media_type = content_type.split(";", 1)[0].strip().lower()
    return media_type == "application/json" or media_type.endswith("+json")

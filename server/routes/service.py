"""What the server says of itself: GET /health, /version, /metrics and the OpenAI model list
(/v1/models, /v1/models/{id}). They answer before the engine serves: /health 503 while it loads,
after it failed or while it stops; /metrics the series it has (the engine's once it serves, its
last snapshot once it stopped).
"""

from __future__ import annotations

import contextlib
import importlib.metadata

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from server.async_engine import EngineDeadError
from server.errors import model_not_found
from server.metrics import CONTENT_TYPE, read_snapshot, render
from server.response_bodies import ModelCard, ModelList
from server.routes.json_bodies import json_response
from server.state import ServerState, server_state

service_router = APIRouter()


def version() -> str:
    try:
        return importlib.metadata.version("specserve")
    except importlib.metadata.PackageNotFoundError:
        return "0+unknown"


@service_router.get("/health")
async def health(request: Request) -> Response:
    """200 while the engine serves; 503 while it loads, after it failed, or while stopping."""
    state = server_state(request.app)
    engine = state.async_engine
    if engine is not None and engine.is_ready:
        return JSONResponse({"status": "ok"})
    if state.lifecycle.load_error is not None:
        status = "failed"
    else:
        status = "loading" if engine is None else "unavailable"
    return JSONResponse({"status": status}, status_code=503)


@service_router.get("/version")
async def get_version() -> Response:
    return JSONResponse({"version": version()})


@service_router.get("/metrics")
async def metrics(request: Request) -> Response:
    state = server_state(request.app)
    engine = state.async_engine
    if engine is not None and engine.is_alive:
        with contextlib.suppress(EngineDeadError):  # then export the last snapshot
            state.metrics_collector.update(await engine.call(read_snapshot))
    return Response(render(state.metrics_registry), media_type=CONTENT_TYPE)


@service_router.get("/v1/models")
async def list_models(request: Request) -> Response:
    card = _model_card(server_state(request.app))
    return json_response(ModelList(data=[card]), exclude_none=True)


@service_router.get("/v1/models/{model_id:path}")
async def get_model(request: Request, model_id: str) -> Response:
    state = server_state(request.app)
    if model_id != state.settings.model_name:
        raise model_not_found(model_id)
    return json_response(_model_card(state), exclude_none=True)


def _model_card(state: ServerState) -> ModelCard:
    engine = state.async_engine
    quantization = getattr(engine.engine, "quantization", None) if engine is not None else None
    return ModelCard(id=state.settings.model_name, created=state.created, quantization=quantization)

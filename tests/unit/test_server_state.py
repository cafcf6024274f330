"""The app's state (server/state.py): one frozen `ServerState` on `app.state`, `Serving` set once
when the engine serves, and the lifecycle its one mutable part. No model: nothing here starts
the lifespan, so the app stays where a loading server is."""

from __future__ import annotations

import dataclasses

import pytest
from fastapi.testclient import TestClient

from engine.models.generation_defaults import GenerationDefaults
from server.app import create_app
from server.async_engine import AsyncEngine
from server.errors import OpenAIError
from server.settings import Settings
from server.state import Lifecycle, ServerState, Serving, server_state


def _serving(async_engine: AsyncEngine) -> Serving:
    return Serving(async_engine, None, None, None, None, GenerationDefaults())


def test_create_app_hangs_one_frozen_state():
    settings = Settings(model="m", served_model_name="tiny")
    app = create_app(settings, started=12.5)
    state = server_state(app)
    assert isinstance(state, ServerState) and state.settings is settings
    assert state.limits == settings.request_limits() and state.started == 12.5
    assert state.given_engine is None and state.serving is None and state.async_engine is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        state.settings = settings  # type: ignore[misc]
    with pytest.raises(OpenAIError) as raised:
        state.ready()
    assert (raised.value.status, raised.value.code) == (503, "engine_unavailable")


def test_a_loading_app_answers_health_and_metrics():
    client = TestClient(create_app(Settings(model="m", served_model_name="tiny")))
    health = client.get("/health")
    assert (health.status_code, health.json()) == (503, {"status": "loading"})
    metrics = client.get("/metrics")
    assert metrics.status_code == 200 and 'model_name="tiny"' in metrics.text
    models = client.get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["tiny"]


def test_serving_is_set_once_and_ready_only_while_the_engine_admits():
    lifecycle = Lifecycle()
    async_engine = AsyncEngine(object(), max_queue=1)  # type: ignore[arg-type]  # never started
    serving = _serving(async_engine)
    lifecycle.begin_serving(serving)
    assert lifecycle.serving is serving
    with pytest.raises(RuntimeError, match="already serves"):
        lifecycle.begin_serving(_serving(async_engine))
    with pytest.raises(dataclasses.FrozenInstanceError):
        serving.token_decoder = None  # type: ignore[misc]

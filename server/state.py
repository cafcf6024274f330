"""The server's state: one `ServerState` per app, which `create_app` builds and hangs on
`app.state` under one name; routes and the CLI read it back with `server_state(app)`.

Three parts, by when each is known:
- `ServerState` (frozen): what `create_app` knows - the settings and the request limits they
  give, the engine it was handed (if any), when it was created and when start-up began, the
  metrics registry with its engine collector, and the HTTP layer's counters.
- `Serving` (frozen): what exists only once the engine serves - the running `AsyncEngine`, the
  served tokenizer's users (`TokenDecoder`, `PromptTokenizer`), the tool parser, the grammar
  worker and the model's generation defaults. Built whole and set once, when serving begins.
- `Lifecycle`: the one mutable part, which `ServerState` owns - `serving` once it begins, the
  load error, the engine's drain once shutdown begins, and the CLI's way to stop the server.
  Only the event loop writes it (the lifespan, `begin_shutdown`, the CLI before it runs).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry
from starlette.applications import Starlette

from engine.models.generation_defaults import GenerationDefaults
from server.async_engine import AsyncEngine
from server.errors import engine_unavailable
from server.grammar_worker import GrammarWorker
from server.metrics import EngineCollector, ServerCollector, ServerCounters, new_registry
from server.prompt_tokenizer import PromptTokenizer
from server.request_limits import RequestLimits
from server.settings import Settings
from server.token_bytes import TokenDecoder
from server.tool_parsers import ToolParser


@dataclass(frozen=True)
class Serving:
    """What the routes use once the engine serves. The tokenizer's users are None for a model
    served without a tokenizer; `tool_parser` is None where the model calls no tools."""

    async_engine: AsyncEngine
    token_decoder: TokenDecoder | None  # logprob token texts and bytes, on the loop
    prompt_tokenizer: PromptTokenizer | None  # chat templates and prompts, on its own thread
    tool_parser: ToolParser | None
    grammar_worker: GrammarWorker | None  # compiles structured-output grammars
    generation_defaults: GenerationDefaults  # the model's sampling defaults, or none

    def close(self) -> None:
        """Stop the worker threads (the engine's own shutdown is the lifespan's)."""
        if self.prompt_tokenizer is not None:
            self.prompt_tokenizer.close()
        if self.grammar_worker is not None:
            self.grammar_worker.close()


@dataclass
class Lifecycle:
    """The facts that change while the app runs, each set once."""

    serving: Serving | None = None  # set when the engine starts serving (begin_serving)
    load_error: Exception | None = None  # why the engine failed to load
    draining: asyncio.Future[None] | None = None  # the engine's shutdown, once begun
    stop_server: Callable[[], None] | None = None  # the CLI's way out when loading fails

    def begin_serving(self, serving: Serving) -> None:
        if self.serving is not None:
            raise RuntimeError("the app already serves an engine")
        self.serving = serving


@dataclass(frozen=True)
class ServerState:
    """Everything one app knows, built by `create_app` (`ServerState.new`)."""

    settings: Settings
    limits: RequestLimits
    given_engine: AsyncEngine | None  # served instead of loading settings.model
    created: int  # Unix time: /v1/models' `created`
    started: float  # time.monotonic() when start-up began: "ready in" counts from it
    metrics_registry: CollectorRegistry
    metrics_collector: EngineCollector  # holds the last engine snapshot /metrics read
    counters: ServerCounters  # the HTTP layer's (server/connections.py)
    lifecycle: Lifecycle = field(default_factory=Lifecycle, compare=False)

    @classmethod
    def new(
        cls, settings: Settings, given_engine: AsyncEngine | None, started: float | None
    ) -> ServerState:
        registry, collector = new_registry(settings.model_name)
        counters = ServerCounters()
        registry.register(ServerCollector(settings.model_name, counters))
        return cls(
            settings=settings,
            limits=settings.request_limits(),
            given_engine=given_engine,
            created=int(time.time()),
            started=time.monotonic() if started is None else started,
            metrics_registry=registry,
            metrics_collector=collector,
            counters=counters,
        )

    @property
    def serving(self) -> Serving | None:
        """What the engine serves with; None until it serves (while loading, or it failed)."""
        return self.lifecycle.serving

    @property
    def async_engine(self) -> AsyncEngine | None:
        serving = self.lifecycle.serving
        return serving.async_engine if serving is not None else None

    def ready(self) -> Serving:
        """What a request is served with: a 503 unless the engine is up and admitting."""
        serving = self.lifecycle.serving
        if serving is None or not serving.async_engine.is_ready:
            raise engine_unavailable()
        return serving


def attach_state(app: Starlette, state: ServerState) -> None:
    """Hang `state` on `app`: its one attribute of app.state."""
    app.state.server = state


def server_state(app: Starlette) -> ServerState:
    """The state `create_app` hung on `app` (a route passes `request.app`)."""
    state = app.state.server
    assert isinstance(state, ServerState), "not an app built by server.app.create_app"
    return state

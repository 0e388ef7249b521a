"""The OpenAI-compatible agent server: one engine, one worker thread, a bounded queue.

:func:`create_app` builds the FastAPI app around an engine (or a factory that loads one in the background, so
``/health`` answers ``loading`` and then ``ready``); :func:`run_server` serves it with uvicorn for
``edgespec serve`` and the systemd unit (sd_notify READY/WATCHDOG/STOPPING, SIGTERM drains then exits 0).

Endpoints: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models``, ``GET /health``,
``GET /metrics``. See ``docs/service.md`` for the contract (status codes, timeouts, telemetry).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from starlette.concurrency import run_in_threadpool

from edgespec import __version__
from edgespec.engine import Completion, Engine
from edgespec.engine import Request as EngineRequest
from edgespec.errors import ConfigError, EdgespecError, ImageError, PromptTooLongError
from edgespec.model_id import HOW_TO_SET
from edgespec.plan import RuntimePlan

from . import logs, protocol, systemd
from .admission import ClientRequests, request_client
from .errors import APIError, SafeJSONResponse, error_body, error_responses, find_invalid_text, install_error_handlers
from .grammar import ANY_OBJECT, JSON_DEFAULTS, AfterThink, GrammarCompiler, JsonConstraint
from .metrics import ServerMetrics
from .middleware import (
    BodyLimitMiddleware,
    ReadTimeoutMiddleware,
    RequestIdMiddleware,
    TenantMiddleware,
    request_id,
    scope_tenant,
)
from .schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    JsonObjectFormat,
    JsonSchemaFormat,
    unsupported_fields,
)
from .tenants import TenantTable
from .tools import DistinctCalls, OutputSplitter, generic_tool_messages, renders_tools, tool_format, tool_grammar
from .transport import GuardedProtocol, guarded_protocol
from .worker import END, EngineWorker, Job, JobError, QueueFull, WorkerStopped

log = logging.getLogger("edgespec.serving")

EngineSource = Engine | Callable[[], Engine]

# A running job this far past its deadline means a hung device: the systemd watchdog stops being petted.
STUCK_GRACE_S = 60.0


class ServerState:
    """Lifecycle and shared objects of one app: ``loading`` -> ``ready`` -> ``draining`` (or ``failed``)."""

    def __init__(self, plan: RuntimePlan, source: EngineSource) -> None:
        self.server, self.sampling = plan.server, plan.sampling     # the plan's parts the server reads
        self.max_seq_len = plan.model.max_seq_len
        self.id_set = _id_source(plan.requests.served_model_name)    # the model card's note on its id
        server = plan.server
        self.metrics = ServerMetrics()
        self.tenants = TenantTable.from_settings(server.api_key, server.api_keys, server.api_keys_file)
        self.client_requests = ClientRequests(server.max_client_requests)
        self.status = "loading"
        self.error: str | None = None
        self.engine: Engine | None = None
        self.worker: EngineWorker | None = None
        self.grammar: GrammarCompiler | None = None
        self.created = protocol.now()
        self.on_fatal: Callable[[], None] | None = None   # run_server: stop uvicorn when loading fails
        self.load_exception: BaseException | None = None
        self.loader: threading.Thread | None = None
        self.generic_tools_logged = False   # the "template has no tool section" line is logged once
        self.draining = asyncio.Event()   # set on drain: a body still being read is answered 503 at once
        self.loop: asyncio.AbstractEventLoop | None = None   # the app's event loop, once it runs
        self._source = source

    # -- lifecycle -------------------------------------------------------------------------------------------
    def start(self) -> None:
        source = self._source
        if callable(source) and not hasattr(source, "complete"):
            systemd.notify("STATUS=loading model")
            self.loader = threading.Thread(target=self._load, args=(source,), name="edgespec-load", daemon=True)
            self.loader.start()
        else:
            self._set_ready(source)  # type: ignore[arg-type]

    def _load(self, factory: Callable[[], Engine]) -> None:
        t0 = time.monotonic()
        try:
            engine = factory()
        except Exception as exc:  # reported through /health and the exit status
            self.load_exception = exc
            self.error = f"{type(exc).__name__}: {exc}"
            self.status = "failed"
            if isinstance(exc, EdgespecError):
                log.error("loading the model failed: %s", exc)
            else:
                log.exception("loading the model failed")
            systemd.notify(f"STATUS=model load failed: {self.error}"[:200])
            if self.on_fatal is not None:
                self.on_fatal()
            return
        log.info("model %s loaded in %.1fs", engine.model_id, time.monotonic() - t0)
        try:
            warm_up(engine)
        except Exception as exc:  # a model that cannot answer one token is not ready: fail as a load failure
            self.load_exception = exc
            self.error = f"warm-up generation failed: {type(exc).__name__}: {exc}"
            self.status = "failed"
            log.exception("the loaded model could not answer a warm-up request")
            systemd.notify(f"STATUS={self.error}"[:200])
            if self.on_fatal is not None:
                self.on_fatal()
            return
        self._set_ready(engine)

    def _set_ready(self, engine: Engine) -> None:
        if self.status != "loading":  # shut down while the model was loading
            log.info("model loaded after shutdown began; not serving it")
            return
        self.engine = engine
        self.grammar = GrammarCompiler(engine.tokenizer, vocab_size(engine))
        self.worker = EngineWorker(engine, self.server.max_queue, self.metrics, STUCK_GRACE_S,
                                   short_tokens=self.server.short_request_tokens)
        self.status = "ready"
        self.metrics.ready.set(1)
        where = f"{self.server.host}:{self.server.port}"
        systemd.notify("READY=1", f"STATUS=serving {engine.model_id} on {where}")

    def begin_drain(self) -> None:
        """Stop taking new work; queued and running requests still finish (SIGTERM)."""
        if self.status in ("draining", "stopped"):
            return
        self.status = "draining"
        loop = self.loop
        if loop is not None and loop.is_running():
            # SIGTERM's handler or another thread: wake the loop, where the event lives.
            loop.call_soon_threadsafe(self.draining.set)
        else:
            self.draining.set()
        self.metrics.ready.set(0)
        if self.worker is not None:
            self.worker.close()
        systemd.notify("STOPPING=1", "STATUS=draining")
        log.info("draining: no new requests, finishing the ones in flight")

    def drain(self) -> None:
        """Wait (blocking) until the engine has no work or ``drain_timeout_s`` passed; then end what is left: the
        running request stops at its next cycle with ``finish_reason`` length (its stream gets the final chunk),
        queued ones get 503 ``draining`` (a paused one ends with what it has, as length)."""
        worker = self.worker
        if worker is None:
            return
        if not worker.wait_idle(self.server.drain_timeout_s):
            log.warning("drain: %d request(s) still in flight after drain_timeout_s %.0fs; ending them",
                        int(worker.busy) + worker.waiting, self.server.drain_timeout_s)
            worker.end_for_drain()
            if not worker.wait_idle(10.0):
                log.warning("drain: the engine did not stop within 10s of the drain deadline")

    def shutdown(self, timeout: float) -> None:
        self.begin_drain()
        self.drain()
        if self.worker is not None:
            if not self.worker.stop(timeout):
                log.warning("engine worker still busy after %.0fs; cancelling", timeout)
                self.worker.cancel_all()
                self.worker.stop(10.0)
        self.status = "stopped"

    def healthy(self) -> bool:
        """For the watchdog: the event loop runs (we are called from it) and no job hangs the device."""
        return self.worker is None or not self.worker.is_stuck()

    # -- request helpers -------------------------------------------------------------------------------------
    def ready_engine(self) -> tuple[Engine, EngineWorker]:
        if self.status == "ready" and self.engine is not None and self.worker is not None:
            return self.engine, self.worker
        if self.status == "loading":
            raise APIError(503, "the model is still loading", code="engine_loading",
                           headers={"Retry-After": "5"})
        if self.status == "failed":
            raise APIError(503, f"the model failed to load: {self.error}", code="engine_failed")
        raise APIError(503, "the server is shutting down", code="draining", headers={"Retry-After": "5"})


def warm_up(engine: Engine) -> None:
    """Generate one token from a one-token prompt, so ``/health`` says ready only once the model answers (kernels
    compiled, CUDA graphs captured, weights paged in) and the first robot request does not pay for that."""
    t0 = time.monotonic()
    first = engine.tokenizer.stop_token_ids[0] if engine.tokenizer.stop_token_ids else 0
    engine.complete(EngineRequest(prompt_ids=[first], max_tokens=1, cache_key="edgespec-warm-up"))
    log.info("warm-up generation done in %.2fs", time.monotonic() - t0)


def vocab_size(engine: Engine) -> int:
    """Width of the model's logits (token ids a client may send / the grammar must mask)."""
    model = getattr(engine, "model", None)
    config = getattr(model, "config", None)
    size = getattr(config, "vocab_size", None)
    return int(size) if size else int(engine.tokenizer.vocab_size)


def _check_model(engine: Engine, name: str | None) -> None:
    if name and name != engine.model_id:
        raise APIError(404, f"the model `{name}` does not exist; this server serves `{engine.model_id}` (its id, "
                       f"{HOW_TO_SET}; default the model folder's name)",
                       param="model", code="model_not_found")


def _check_fields(body: ChatCompletionRequest | CompletionRequest) -> None:
    bad = unsupported_fields(body)
    if bad:
        raise APIError(400, f"unsupported field(s): {', '.join(bad)} (edgespec serves one text choice, no "
                       "logprobs or penalties)", param=bad[0], code="unsupported_field")
    if body.stream_options is not None and not body.stream:
        raise APIError(400, "stream_options is only allowed with stream: true", param="stream_options",
                       code="invalid_request")


def _prepare(state: ServerState, engine: Engine, req: EngineRequest,
             body: ChatCompletionRequest | CompletionRequest) -> tuple[EngineRequest, OutputSplitter | None]:
    """Validate and tokenise before queueing (runs in a thread: grammars, templates and tokenisers are CPU work).
    Schemas are compiled first, so a bad one is reported as such even when the prompt is also too long. Returns the
    request and, for chat, the splitter its output goes through (reasoning, content, tool calls)."""
    param = "messages" if isinstance(body, ChatCompletionRequest) else "prompt"
    assert state.grammar is not None
    fmt = body.response_format
    if isinstance(fmt, (JsonObjectFormat, JsonSchemaFormat)):
        try:
            if isinstance(fmt, JsonObjectFormat):
                req.constraint = state.grammar.json_object()
            else:
                schema = fmt.json_schema.json_schema
                req.constraint = state.grammar.json_schema(schema if schema is not None else ANY_OBJECT)
        except EdgespecError as exc:
            raise APIError(400, str(exc), param="response_format", code="invalid_schema") from None
    generic = req.messages is not None and not renders_tools(engine.tokenizer.chat_template) and (
        bool(req.tools) or any(m.get("role") == "tool" or m.get("tool_calls") for m in req.messages))
    tool_fmt = "json" if generic else tool_format(engine.tokenizer.chat_template)
    plan = protocol.tool_plan(body) if isinstance(body, ChatCompletionRequest) else None
    parallel = plan is not None and protocol.parallel_calls(body)
    forced = _tool_constraint(state, body, plan, tool_fmt, req.constraint is not None) if plan is not None else None
    if forced is not None and parallel:
        assert plan is not None
        forced = DistinctCalls(forced, engine.tokenizer.detokenizer(skip_special_tokens=False), tool_fmt,
                               plan.by_name)
    if generic:
        if not state.generic_tools_logged:
            state.generic_tools_logged = True
            log.info("the chat template of %s has no tool section: tools are rendered into the system turn in "
                     "edgespec's generic <tool_call> JSON format (docs/service.md)", engine.model_id)
        assert req.messages is not None
        req.messages, req.tools = generic_tool_messages(req.messages, req.tools), None
    try:
        ids = engine.check(req)
    except PromptTooLongError as exc:
        raise APIError(400, str(exc), param=param, code="context_length_exceeded") from None
    except ImageError as exc:
        raise APIError(400, str(exc), param=exc.param or param, code="invalid_image") from None
    except EdgespecError as exc:
        p = "edgespec.num_draft_tokens" if "num_draft_tokens" in str(exc) else param
        raise APIError(400, str(exc), param=p, code="invalid_request") from None
    req.prompt_ids, req.messages, req.prompt = ids, None, None
    req.max_tokens = protocol.bounded_max_tokens(body, state.sampling, len(ids), engine.session.cache.max_len)
    if not isinstance(body, ChatCompletionRequest):
        return req, None
    in_think = _opens_in_think(engine, ids)
    if forced is not None:
        think = engine.think_ids
        req.constraint = AfterThink(forced, think[1]) if in_think and think is not None else forced
    split = OutputSplitter(in_think=in_think, parse_tools=plan is not None and plan.parse, fmt=tool_fmt,
                           tools=plan.by_name if plan is not None else None,
                           split_reasoning=engine.think_ids is not None, distinct=parallel)
    return req, split


def _tool_constraint(state: ServerState, body: ChatCompletionRequest, plan: protocol.ToolPlan, tool_fmt: str,
                     has_format: bool) -> JsonConstraint | None:
    # required: exactly one call, or with parallel_tool_calls: true up to max_tool_calls distinct ones; a named
    # function: that one call.
    """Compile the tools' grammar under every tool_choice, so a bad schema is the same 400 whether or not this
    request forces a call (a schema the grammar cannot hold is one the model should not be shown either); the
    grammar when a call is forced, else None."""
    assert state.grammar is not None
    if plan.forced is not None and has_format:
        raise APIError(400, "response_format and a required tool call cannot be combined", param="tool_choice",
                       code="invalid_request")
    try:
        grammar = state.grammar.lark(tool_grammar(plan.forced or list(plan.by_name.values()), tool_fmt,
                                                  JSON_DEFAULTS, protocol.parallel_calls(body),
                                                  state.server.max_tool_calls), param="tools")
    except EdgespecError as exc:
        raise APIError(400, str(exc), param="tools", code="invalid_schema") from None
    return grammar if plan.forced is not None else None


def _opens_in_think(engine: Engine, ids: list[int]) -> bool:
    """True when the prompt ends inside a ``<think>`` block (thinking on): the output starts as reasoning."""
    think = engine.think_ids
    if think is None:
        return False
    for t in reversed(ids):
        if t in think:
            return t == think[0]
    return False


def _sse(data: dict[str, Any] | str) -> str:
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return f"data: {text}\n\n"


async def _watch_disconnect(request: Request, job: Job, worker: EngineWorker, metrics: ServerMetrics) -> None:
    """Cancel ``job`` when the client goes away (queued: withdrawn; running: stops at the next cycle)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            break
    job.cancel()
    if worker.withdraw(job):
        if job.stream:   # a non-streamed job answers 499, which the HTTP layer counts
            metrics.fail("cancelled")
        if not job.future.done():
            job.future.set_exception(JobError(499, "client closed the request", "cancelled"))
        if job.events is not None:
            job.events.put_nowait(END)
    log.info("client disconnected; request cancelled")


def _job_error(exc: BaseException) -> APIError:
    if isinstance(exc, JobError):
        headers = {"Retry-After": "1"} if exc.status == 503 else None
        return APIError(exc.status, exc.message, param=exc.param, code=exc.code, headers=headers)
    return APIError(500, f"internal error: {type(exc).__name__}", code="internal_error")


def create_app(engine: EngineSource, plan: RuntimePlan) -> FastAPI:
    """The FastAPI app serving ``engine`` (an Engine, or a zero-argument factory loaded in the background) with
    the server limits and sampling defaults of ``plan``."""
    state = ServerState(plan, engine)
    app = FastAPI(title="edgespec agent server", version=__version__, lifespan=_lifespan(state), docs_url=None,
                  redoc_url=None, default_response_class=SafeJSONResponse)
    app.state.edgespec = state
    install_error_handlers(app)
    _add_middleware(app, state)
    _add_completion_routes(app, state)
    _add_model_routes(app, state)
    _add_status_routes(app, state)
    return app


def _lifespan(state: ServerState) -> Callable[[FastAPI], contextlib.AbstractAsyncContextManager[None]]:
    """The app's lifespan: start loading (or serving) the engine and the watchdog; on exit drain and stop."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state.loop = asyncio.get_running_loop()
        state.start()
        pinger = None
        interval = systemd.watchdog_interval()
        if interval:
            pinger = asyncio.create_task(_watchdog(state, interval))
        try:
            yield
        finally:
            if pinger is not None:
                pinger.cancel()
            await run_in_threadpool(state.shutdown, 10.0 + state.server.request_timeout_s)

    return lifespan


def _add_middleware(app: FastAPI, state: ServerState) -> None:
    """API key (when set), body limit, read timeout, then request id: each added one wraps the ones before it."""
    server = state.server
    app.add_middleware(TenantMiddleware, tenants=state.tenants)
    app.add_middleware(BodyLimitMiddleware, max_bytes=server.max_body_bytes)
    app.add_middleware(ReadTimeoutMiddleware, read_timeout_s=server.read_timeout_s, draining=state.draining)
    app.add_middleware(RequestIdMiddleware, on_failure=state.metrics.fail)   # outermost: sees every answer


def _auth_errors(state: ServerState) -> tuple[int, ...]:
    """The 401 a route documents when an API key is required, else nothing."""
    return (401,) if state.tenants.required else ()


def _add_completion_routes(app: FastAPI, state: ServerState) -> None:
    """``POST /v1/chat/completions`` and ``POST /v1/completions``, both through :func:`_run_job`."""
    generation_errors = error_responses(400, *_auth_errors(state), 404, 408, 413, 422, 429, 500, 503, 504)
    # Streamed answers: SSE events whose data lines are chat.completion.chunk / text_completion JSON, then [DONE].
    sse = {"text/event-stream": {}}

    @app.post("/v1/chat/completions", summary="Chat completion (OpenAI-compatible)",
              responses={200: {"description": "a chat.completion, or SSE chunks with stream: true", "content": sse},
                         **generation_errors})
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await _run_job(state, request, body, chat=True)

    @app.post("/v1/completions", summary="Text completion of a raw prompt (OpenAI-compatible)",
              responses={200: {"description": "a text_completion, or SSE chunks with stream: true", "content": sse},
                         **generation_errors})
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await _run_job(state, request, body, chat=False)


async def _run_job(state: ServerState, request: Request, body: ChatCompletionRequest | CompletionRequest,
                   chat: bool) -> Response:
    """Check, prepare and queue one completion request; answer it whole, or as SSE when ``stream`` is set."""
    arrived = time.monotonic()
    eng, worker = state.ready_engine()
    _check_model(eng, body.model)
    _check_fields(body)
    bad = find_invalid_text(body.model_dump(by_alias=True, exclude_none=True))
    if bad is not None:
        raise APIError(400, f"{bad} holds text that is not valid Unicode (a lone surrogate such as \\ud800)",
                       param=bad, code="invalid_unicode")
    req = protocol.engine_request(body, state.sampling, vocab_size(eng))
    tenant, host = scope_tenant(request.scope), request.client.host if request.client else None
    req.cache_key = protocol.client_key(tenant, host, body)
    req, split = await run_in_threadpool(_prepare, state, eng, req, body)
    job = Job(req, asyncio.get_running_loop(), deadline=arrived + state.server.request_timeout_s,
              stream=body.stream)
    job.arrived = arrived
    job.request_id = request_id.get()
    _submit(state, worker, job, request_client(tenant, host))
    watcher = asyncio.create_task(_watch_disconnect(request, job, worker, state.metrics))
    rid = protocol.new_id("chatcmpl" if chat else "cmpl")
    created = protocol.now()
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        maker = protocol.ChunkMaker(chat, rid, created, eng.model_id, include_usage)
        return StreamingResponse(_stream(job, maker, watcher, worker, split), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    try:
        completion: Completion = await job.future
    except Exception as exc:
        raise _job_error(exc) from None
    finally:
        watcher.cancel()
        if not job.future.done():
            job.cancel()
            worker.withdraw(job)
    extra = protocol.telemetry(completion, queue_ms=job.queue_s * 1000.0, timed_out=job.timed_out)
    if split is not None:
        out = protocol.chat_response(rid, created, eng.model_id, completion, extra, job.timed_out, split)
    else:
        out = protocol.text_response(rid, created, eng.model_id, completion, extra, job.timed_out)
    return SafeJSONResponse(out)


def _submit(state: ServerState, worker: EngineWorker, job: Job, client: str) -> None:
    """Queue ``job`` for ``client``: 429 when the client already has ``max_client_requests`` in flight or the queue
    is full, 503 while draining. The client's count is given back when the job is settled."""
    requests = state.client_requests
    if not requests.take(client):
        raise APIError(429, f"this client already has {requests.limit} requests queued or running "
                       "(max_client_requests); retry when one finishes", code="client_busy",
                       headers={"Retry-After": str(worker.retry_after())})
    try:
        worker.submit(job)
    except QueueFull as exc:
        requests.give_back(client)
        raise APIError(429, f"the engine is busy ({worker.max_queue} requests already waiting); retry "
                       "later", code="queue_full",
                       headers={"Retry-After": str(exc.retry_after)}) from None
    except WorkerStopped:
        requests.give_back(client)
        raise APIError(503, "the server is shutting down", code="draining",
                       headers={"Retry-After": "5"}) from None
    job.future.add_done_callback(lambda _: requests.give_back(client))


async def _stream(job: Job, maker: protocol.ChunkMaker, watcher: asyncio.Task,
                  worker: EngineWorker, split: OutputSplitter | None) -> AsyncIterator[str]:
    """The SSE events of a streamed job: deltas as tokens come, the final chunk (and usage), then ``[DONE]``;
    a client gone or done early withdraws the job."""
    assert job.events is not None
    try:
        first = maker.first()
        if first is not None:
            yield _sse(first)
        while True:
            item = await job.events.get()
            if item is END:
                break
            if split is None:
                yield _sse(maker.text(item))
            else:
                for chunk in maker.deltas(split.feed(item)):
                    yield _sse(chunk)
        if split is not None:
            for chunk in maker.deltas(split.finish()):
                yield _sse(chunk)
        exc = job.future.exception()
        if exc is not None:
            err = _job_error(exc)
            yield _sse(error_body(err.status, err.message, param=err.param, code=err.code))
        else:
            completion: Completion = job.future.result()
            extra = protocol.telemetry(completion, queue_ms=job.queue_s * 1000.0, timed_out=job.timed_out)
            yield _sse(maker.final(completion, extra, job.timed_out))
            if maker.include_usage:
                yield _sse(maker.usage(completion, extra))
        yield _sse("[DONE]")
    finally:
        watcher.cancel()
        if not job.future.done():
            job.cancel()
            worker.withdraw(job)


def _model_card(state: ServerState, eng: Engine) -> dict[str, Any]:
    """The OpenAI model object of the served model."""
    return {"id": eng.model_id, "object": "model", "created": state.created, "owned_by": "edgespec",
            "max_model_len": state.max_seq_len, "id_set": state.id_set}


def _id_source(served_model_name: str | None) -> str:
    """Where the served id comes from, for the model card: the setting, or the default and how to change it."""
    if served_model_name:
        return "served_model_name"
    return f"default: the name of the model folder or GGUF file; {HOW_TO_SET}"


def _add_model_routes(app: FastAPI, state: ServerState) -> None:
    """``GET /v1/models`` (the one served model) and ``GET /v1/models/{model}``."""
    auth = _auth_errors(state)

    @app.get("/v1/models", summary="The served model", responses=error_responses(*auth, 408, 413, 500, 503))
    async def models() -> dict[str, Any]:
        eng, _ = state.ready_engine()
        return {"object": "list", "data": [_model_card(state, eng)]}

    @app.get("/v1/models/{model:path}", summary="One model",
             responses=error_responses(*auth, 404, 408, 413, 422, 500, 503))
    async def model(model: str) -> dict[str, Any]:
        eng, _ = state.ready_engine()
        _check_model(eng, model)
        return _model_card(state, eng)


def _add_status_routes(app: FastAPI, state: ServerState) -> None:
    """``GET /health`` (the lifecycle, 503 unless ready) and ``GET /metrics`` (Prometheus text)."""

    @app.get("/health", summary="loading | ready | draining | failed (503 unless ready)",
             responses={503: {"description": "not ready: loading, failed or draining (same body)"},
                        **error_responses(408, 413, 500)})
    async def health() -> SafeJSONResponse:
        body: dict[str, Any] = {"status": state.status}
        if state.engine is not None:
            body["model"] = state.engine.model_id
            body["drafter"] = state.engine.session.drafter_name
        if state.worker is not None:
            body["running"] = int(state.worker.busy)
            body["waiting"] = state.worker.waiting
        if state.error:
            body["error"] = state.error
        return SafeJSONResponse(body, status_code=200 if state.status == "ready" else 503)

    @app.get("/metrics", summary="Prometheus metrics",
             responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}},
                        **error_responses(408, 413, 500)})
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=state.metrics.content_type)


async def _watchdog(state: ServerState, interval: float) -> None:
    """Pet the systemd watchdog while the loop runs and the engine is not hung."""
    while True:
        if state.healthy():
            systemd.notify("WATCHDOG=1")
        else:
            log.error("engine worker stuck past its deadline; not petting the watchdog")
        await asyncio.sleep(interval)


# ---- run_server --------------------------------------------------------------------------------------------


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and loopback IP literals (127.0.0.0/8, ::1)."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class _Server(uvicorn.Server):
    """uvicorn that drains before it stops listening: the first SIGTERM/SIGINT starts the drain (``/health`` answers
    503 ``draining``, new requests 503) and uvicorn's own shutdown starts only once the engine is idle or
    ``drain_timeout_s`` ended what was left; a second signal stops at once. The exit status stays clean."""

    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self._state = state
        self._drainer: threading.Thread | None = None

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self._drainer is None and not self.should_exit:
            self._state.begin_drain()
            self._drainer = threading.Thread(target=self._drain_then_exit, name="edgespec-drain", daemon=True)
            self._drainer.start()
        else:
            super().handle_exit(sig, frame)
        # uvicorn re-raises captured signals after shutdown (the process would die of SIGTERM); a drained
        # shutdown is a clean exit, so forget them.
        self._captured_signals.clear()

    def _drain_then_exit(self) -> None:
        try:
            self._state.drain()
        finally:
            self.should_exit = True


def bind_socket(host: str, port: int) -> socket.socket:
    """The listening socket, bound before anything else starts (a taken port is then one clear error, before the
    model starts loading). Raises OSError."""
    family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host.strip("[]"), port))
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def http_protocol(state: ServerState) -> type[GuardedProtocol]:
    """The connection layer of ``state``'s server (serving.transport), its refusals and open connections counted in
    ``/metrics``."""
    server, metrics = state.server, state.metrics
    return guarded_protocol(server.read_timeout_s, server.max_connections,
                            max_client_connections=server.max_client_connections,
                            on_refusal=metrics.refuse_connection, on_open=metrics.connections_open.set)


def run_server(plan: RuntimePlan, *, engine_factory: Callable[[], Engine] | None = None,
               log_level: str = "info") -> int:
    """Serve ``plan``'s model on its server's ``host:port`` until SIGTERM/SIGINT; returns the exit status.

    The model loads in the background (``/health`` says ``loading``, then ``ready``; systemd gets READY=1).
    Raises ConfigError before binding a non-loopback address without ``api_key``, and re-raises an
    EdgespecError that made the model load fail (the CLI prints it on one line). Returns 0 after a drain (also
    when SIGTERM came while the model was loading), 1 when the port cannot be bound (one line on stderr, nothing
    loaded) or the model failed to load for another reason.
    """
    server = plan.server
    if not is_loopback(server.host) and not server.authenticated:
        raise ConfigError(f"host {server.host!r} is not a loopback address: set api_key (EDGESPEC_API_KEY), "
                          "api_keys or api_keys_file before serving beyond this machine")
    logs.configure(log_level)
    try:
        sock = bind_socket(server.host, server.port)
    except OSError as exc:
        print(f"edgespec: error: cannot listen on {server.host}:{server.port}: {exc.strerror or exc}",
              file=sys.stderr)
        return 1
    factory = engine_factory or (lambda: Engine.load(plan))
    app = create_app(factory, plan)
    state: ServerState = app.state.edgespec
    config = uvicorn.Config(app, log_level=log_level, lifespan="on", log_config=None,
                            timeout_graceful_shutdown=15.0, timeout_keep_alive=5, server_header=False,
                            http=http_protocol(state))
    server = _Server(config, state)

    def fatal() -> None:
        server.should_exit = True

    state.on_fatal = fatal
    try:
        server.run(sockets=[sock])
        status = 0
    except SystemExit as exc:  # uvicorn exits on lifespan failure after logging it
        status = int(exc.code) if isinstance(exc.code, int) else 1
    finally:
        sock.close()
    if state.loader is not None and state.loader.is_alive():
        # Stopped while the model loads. The loader thread is inside torch/safetensors code and cannot be
        # interrupted; a normal interpreter exit would run C++ static destructors (torch's thread pools) under it,
        # which ends in std::terminate ("terminate called without an active exception", SIGABRT, exit 134). Nothing
        # is left to clean up (no request was served), so leave without those destructors.
        log.info("stopped while the model was loading; exiting without waiting for it")
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    if state.load_exception is not None:
        if isinstance(state.load_exception, EdgespecError):
            raise state.load_exception
        return 1
    return status

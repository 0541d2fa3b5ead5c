"""`moetune serve`: the OpenAI-compatible HTTP server (FastAPI + uvicorn) over the engine thread.

Routes: POST /v1/completions, POST /v1/chat/completions (SSE streaming or not), GET /v1/models
(with the tuned profile in use), GET /info (profile, knobs, KV-cache use, queue), GET /health,
GET /metrics (Prometheus text). The event loop only queues work for the engine thread and waits
on tokens; a client that goes away cancels its request, which frees its KV blocks.
"""
from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
import logging
import os
import time
from contextlib import asynccontextmanager
from pathlib import Path
from typing import AsyncIterator

from fastapi import FastAPI, Request as HttpRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.async_engine import EngineThread, TokenEvent
from engine.errors import MoetuneError
from engine.llm import LLM, RequestOutput, SamplingParams
from engine.protocol import (ApiError, ChatChoice, ChatChunk, ChatChunkChoice, ChatDelta, ChatRequest,
                             ChatResponse, ChatResponseMessage, CompletionChoice, CompletionRequest,
                             CompletionResponse, ServerOptions, Usage, new_id)
from engine.scheduler import Request

log = logging.getLogger("moetune")

DISCONNECT_POLL_S = 0.5  # how often a non-streaming request checks that its client is still there


# ---------------------------------------------------------------- requests → engine


def _prompt_ids(llm: LLM, prompt) -> list[int]:
    """One prompt (text or token ids, or a list holding exactly one of them) as token ids."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise ApiError(400, "only one prompt per request is supported", "prompt")
        prompt = prompt[0]
    try:
        return llm._encode(prompt)
    except MoetuneError as e:
        raise ApiError(400, str(e), "prompt") from None


def _chat_ids(llm: LLM, body: ChatRequest) -> list[int]:
    tok = llm.tokenizer
    if tok is None or not tok.has_chat_template:
        raise ApiError(400, "this model has no chat template: use /v1/completions", "messages")
    messages = [{"role": m.role, "content": m.text(), **({"name": m.name} if m.name else {})}
                for m in body.messages]
    try:
        return tok.encode(tok.apply_chat_template(messages), add_bos=False)
    except MoetuneError as e:
        raise ApiError(400, str(e), "messages") from None


def _sampling(llm: LLM, body, ids: list[int], default_max: int | None) -> SamplingParams:
    """Checked SamplingParams; ids are checked against the vocabulary and the context."""
    max_tokens = getattr(body, "max_completion_tokens", None) or body.max_tokens
    if max_tokens is None:
        max_tokens = default_max if default_max is not None else llm.max_context - len(ids)
    if max_tokens < 1:
        raise ApiError(400, f"max_tokens must be at least 1, got {max_tokens}", "max_tokens")
    if any(not s for s in body.stop_list):
        raise ApiError(400, "stop strings must not be empty", "stop")
    try:
        llm._check_prompt(ids, max_tokens)
    except MoetuneError as e:
        code = "context_length_exceeded" if "context" in str(e) else None
        raise ApiError(400, str(e), "max_tokens" if code and len(ids) < llm.max_context else "prompt", code) from None
    return SamplingParams(max_tokens=max_tokens, temperature=1.0 if body.temperature is None else body.temperature,
                          top_p=1.0 if body.top_p is None else body.top_p, top_k=max(0, body.top_k or 0),
                          seed=body.seed, stop=body.stop_list, ignore_eos=body.ignore_eos)


def _stable(text: str, stops: list[str]) -> str:
    """What may be streamed of an unfinished text: not a trailing partial UTF-8 character, nor a
    tail that could still grow into a stop string (it would be cut from the final text)."""
    text = text.rstrip("\ufffd")
    hold = max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
    return text[: len(text) - hold]


class Generation:
    """One request's way through the engine, seen from the event loop."""

    def __init__(self, engine: EngineThread, ids: list[int], params: SamplingParams):
        self.engine, self.params = engine, params
        self.req = Request(RequestOutput(ids), params)
        self.events: asyncio.Queue[TokenEvent] = asyncio.Queue()
        self.final: TokenEvent | None = None
        loop = asyncio.get_running_loop()
        engine.submit(self.req, lambda ev: loop.call_soon_threadsafe(self.events.put_nowait, ev))

    @property
    def prompt_tokens(self) -> int:
        return len(self.req.out.prompt_token_ids)

    def cancel(self) -> None:
        if self.final is None:
            self.engine.cancel(self.req)

    async def deltas(self) -> AsyncIterator[tuple[str, TokenEvent]]:
        """(new text, event) per step until the request finishes; the texts add up to the final text."""
        sent = ""
        while self.final is None:
            ev = await self.events.get()
            if ev.finish_reason is not None:
                self.final = ev
            if ev.error:
                raise ApiError(500, ev.error)
            text = ev.text if ev.finish_reason else _stable(ev.text, self.params.stop_strings)
            delta = text[len(sent):] if text.startswith(sent) else ""
            sent += delta
            yield delta, ev

    async def result(self, http: HttpRequest) -> TokenEvent:
        """The final event, cancelling the request if the client disconnects first."""
        try:
            while self.final is None:
                try:
                    ev = await asyncio.wait_for(self.events.get(), DISCONNECT_POLL_S)
                except asyncio.TimeoutError:
                    if await http.is_disconnected():
                        raise ApiError(400, "the client disconnected") from None
                    continue
                if ev.error:
                    raise ApiError(500, ev.error)
                self.final = ev if ev.finish_reason is not None else None
            return self.final
        finally:
            self.cancel()


# ---------------------------------------------------------------- the app


def _sse(obj) -> str:
    data = obj.model_dump_json(exclude_none=False) if hasattr(obj, "model_dump_json") else json.dumps(obj)
    return f"data: {data}\n\n"


class Server:
    """Route handlers bound to one engine and the name it is served under."""

    def __init__(self, llm: LLM, name: str, options: ServerOptions | None = None):
        self.llm, self.name = llm, name
        self.options = options or ServerOptions()
        self.engine = EngineThread(llm)
        self.created = int(time.time())

    def check_model(self, model: str) -> None:
        if model != self.name:
            raise ApiError(404, f"The model `{model}` does not exist (this server serves `{self.name}`)",
                           "model", "model_not_found")

    def _paths(self, http: HttpRequest) -> bool:
        return self.options.show_paths(getattr(http.state, "authenticated", False))

    def profile_info(self, paths: bool) -> dict | None:
        p = self.llm.profile
        if p is None:
            return None
        return {"path": str(p.path) if paths else None, "hardware_key": p.hardware_key, "model_key": p.model_key,
                "knobs": dict(p.knobs), "kernel_tables": {op: len(rows) for op, rows in p.kernel_tables.items()}}

    def models(self, http: HttpRequest) -> dict:
        paths = self._paths(http)
        card = {"id": self.name, "object": "model", "created": self.created, "owned_by": "moetune",
                "root": str(self.llm.path) if paths else None, "max_model_len": self.llm.max_context,
                "profile": self.profile_info(paths)}
        return {"object": "list", "data": [card]}

    def info(self, http: HttpRequest) -> dict:
        state = self.engine.metrics.snapshot()
        paths = self._paths(http)
        return {"model": self.name, "path": str(self.llm.path) if paths else None, "model_key": self.llm.model_key,
                "dtype": str(self.llm.dtype).removeprefix("torch."), "profile": self.profile_info(paths),
                "knobs": self.llm.knobs, "kernel_calls": self.llm.explain(), "max_model_len": self.llm.max_context,
                "vocab_size": self.llm.config.vocab_size,
                "kv_blocks_total": state["kv_total"], "kv_blocks_used": state["kv_used"],
                "kv_block_size": self.llm.cache.block_size, "requests_waiting": state["waiting"],
                "requests_running": state["running"], "preemptions": state["preemptions"]}

    # ------------------------------------------------------------ completions

    async def completions(self, body: CompletionRequest, http: HttpRequest):
        self.check_model(body.model)
        ids = _prompt_ids(self.llm, body.prompt)
        gen = Generation(self.engine, ids, _sampling(self.llm, body, ids, default_max=16))
        rid, created = new_id("cmpl")

        def response(text: str, finish: str | None, usage: Usage | None = None) -> CompletionResponse:
            return CompletionResponse(id=rid, created=created, model=self.name, usage=usage,
                                      choices=[CompletionChoice(text=text, finish_reason=finish)])

        if not body.stream:
            ev = await gen.result(http)
            return response(ev.text, ev.finish_reason, Usage.of(gen.prompt_tokens, ev.num_tokens))

        async def chunks():  # one chunk per token (its text may be held back: see _stable)
            async for delta, ev in gen.deltas():
                yield _sse(response(delta, ev.finish_reason))

        return self._stream(gen, chunks(), lambda usage: _sse(response("", None, usage).model_copy(
            update={"choices": []})), body)

    # ------------------------------------------------------------ chat

    async def chat(self, body: ChatRequest, http: HttpRequest):
        self.check_model(body.model)
        ids = _chat_ids(self.llm, body)
        gen = Generation(self.engine, ids, _sampling(self.llm, body, ids, default_max=None))
        rid, created = new_id("chatcmpl")

        if not body.stream:
            ev = await gen.result(http)
            choice = ChatChoice(message=ChatResponseMessage(content=ev.text), finish_reason=ev.finish_reason)
            return ChatResponse(id=rid, created=created, model=self.name, choices=[choice],
                                usage=Usage.of(gen.prompt_tokens, ev.num_tokens))

        def chunk(delta: ChatDelta, finish: str | None = None) -> str:
            return _sse(ChatChunk(id=rid, created=created, model=self.name,
                                  choices=[ChatChunkChoice(delta=delta, finish_reason=finish)]))

        async def chunks():
            yield chunk(ChatDelta(role="assistant", content=""))
            async for delta, ev in gen.deltas():  # one chunk per token, as for completions
                yield chunk(ChatDelta(content=delta), ev.finish_reason)

        return self._stream(gen, chunks(), lambda usage: _sse(ChatChunk(
            id=rid, created=created, model=self.name, choices=[], usage=usage)), body)

    def _stream(self, gen: Generation, chunks, usage_chunk, body) -> StreamingResponse:
        include_usage = body.stream_options is not None and body.stream_options.include_usage

        async def events():
            try:
                async for text in chunks:
                    yield text
                if include_usage:
                    yield usage_chunk(Usage.of(gen.prompt_tokens, gen.final.num_tokens))
            except ApiError as e:
                yield f"data: {json.dumps(e.body())}\n\n"
            finally:
                gen.cancel()  # a client gone mid-stream: its blocks are freed at the next step
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})


# ---------------------------------------------------------------- access


class Gate:
    """ASGI middleware in front of every route: the API key (`Authorization: Bearer KEY`, compared
    in constant time with every configured key) on all routes but /health (and /metrics when
    metrics_public). A client that passes is marked `request.state.authenticated`. No key is ever
    logged or echoed."""

    def __init__(self, app, options: ServerOptions):
        self.app, self.options = app, options
        self.keys = [k.encode() for k in options.api_keys]

    def _open(self, path: str) -> bool:
        return path == "/health" or (path == "/metrics" and self.options.metrics_public)

    def _authorized(self, scope) -> bool:
        header = next((v for k, v in scope.get("headers", ()) if k == b"authorization"), b"")
        scheme, _, token = header.partition(b" ")
        token = token.strip() if scheme.lower() == b"bearer" else b""
        # every key compared (no early exit on a match), each in constant time
        return bool(token) and any([hmac.compare_digest(token, key) for key in self.keys])

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        authed = bool(self.keys) and self._authorized(scope)
        if self.keys and not authed and not self._open(scope["path"]):
            body = ApiError(401, "Missing or invalid API key: send `Authorization: Bearer <key>`",
                            code="invalid_api_key").body()
            resp = JSONResponse(body, status_code=401, headers={"WWW-Authenticate": "Bearer"})
            return await resp(scope, receive, send)
        scope.setdefault("state", {})["authenticated"] = authed
        await self.app(scope, receive, send)


# ---------------------------------------------------------------- error mapping


def _error(e: ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    err = exc.errors()[0]
    loc = [str(x) for x in err.get("loc", ()) if x != "body"]
    param = ".".join(loc) or None
    if err.get("type") == "json_invalid":
        return f"We could not parse the JSON body of your request ({err.get('msg')})", None
    if err.get("type") == "extra_forbidden":
        return f"Unrecognized request argument supplied: {param}", param
    return f"{param or 'body'}: {err.get('msg')}", param


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(_, e: ApiError):
        return _error(e)

    @app.exception_handler(RequestValidationError)
    async def invalid(_, exc: RequestValidationError):
        message, param = _validation_message(exc)
        return _error(ApiError(400, message, param))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_, exc: StarletteHTTPException):
        return _error(ApiError(exc.status_code, str(exc.detail)))

    @app.exception_handler(Exception)
    async def internal(_, exc: Exception):
        log.exception("internal error")
        return _error(ApiError(500, f"internal error: {type(exc).__name__}"))


def create_app(llm: LLM, name: str, options: ServerOptions | None = None) -> FastAPI:
    server = Server(llm, name, options)

    @asynccontextmanager
    async def lifespan(_):
        server.engine.start()
        yield
        server.engine.stop()

    app = FastAPI(title="moetune", lifespan=lifespan)
    app.state.server = server
    app.add_middleware(Gate, options=server.options)
    _install_error_handlers(app)
    app.post("/v1/completions")(server.completions)
    app.post("/v1/chat/completions")(server.chat)
    app.get("/v1/models")(server.models)
    app.get("/info")(server.info)

    @app.get("/health")
    async def health():
        alive = server.engine._thread.is_alive()
        return JSONResponse({"status": "ok" if alive else "engine stopped"}, status_code=200 if alive else 503)

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(server.engine.metrics.render(), media_type="text/plain; version=0.0.4")

    return app


# ---------------------------------------------------------------- moetune serve


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: not known to be loopback
        return False


def options_from_args(args) -> ServerOptions:
    """ServerOptions from `moetune serve`'s flags; keys from --api-key and MOETUNE_API_KEY."""
    keys = [k for k in [*(args.api_key or []), os.environ.get("MOETUNE_API_KEY", "")] if k]
    return ServerOptions(api_keys=keys, metrics_public=args.metrics_public, loopback=_is_loopback(args.host))


def serve(args) -> int:
    """`moetune serve`: load the model with this machine's tuned profile (or the given one) and serve."""
    import uvicorn

    options = options_from_args(args)
    if not options.api_keys and not options.loopback:
        log.warning("no API key (--api-key or MOETUNE_API_KEY) on a non-loopback address: anyone who "
                    "can reach %s:%d can use the model", args.host, args.port)
    llm = LLM(args.model, dtype=args.dtype, profile=args.profile or "auto", knobs=dict(args.knob or []),
              force_profile=args.force_profile, device=args.device)
    name = args.served_model_name or (args.model if not Path(args.model).exists() else Path(args.model).name)
    which = f"tuned profile {llm.profile.path}" if llm.profile else "the default knobs (no tuned profile)"
    log.info("serving %s (%s) with %s on http://%s:%d", name, llm.model_key, which, args.host, args.port)
    log.info("authentication: %s", f"{len(options.api_keys)} API key(s)" if options.api_keys else "none")
    uvicorn.run(create_app(llm, name, options), host=args.host, port=args.port, log_level="warning", access_log=False)
    return 0

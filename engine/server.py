"""`moetune serve`: the OpenAI-compatible HTTP server (FastAPI + uvicorn) over the engine thread.

Routes: POST /v1/completions, POST /v1/chat/completions (SSE streaming or not), GET /v1/models
(with the tuned profile in use), GET /info (profile, knobs, KV-cache use, queue), GET /health,
GET /metrics (Prometheus text). The event loop only queues work for the engine thread and waits
on tokens; a client that goes away cancels its request, which frees its KV blocks.

Completions take several prompts, n samples each (best_of: the likeliest n of more), logprobs
and echo; chat takes n, logprobs and top_logprobs. In front of every route, `Gate` checks the API
key and the body size; ServerOptions holds the limits. SIGTERM / SIGINT drain the server
(`Server.drain`) and exit 0.
"""
from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
import logging
import os
import signal
import threading
import time
from contextlib import asynccontextmanager
from dataclasses import replace
from pathlib import Path
from typing import AsyncIterator

from fastapi import FastAPI, Request as HttpRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.async_engine import EngineThread, TokenEvent
from engine.errors import MoetuneError
from engine.llm import LLM, RequestOutput, SamplingParams
from engine.logprob_format import TokenTexts, chat_logprobs, completion_logprobs
from engine.protocol import (ApiError, ChatChoice, ChatChunk, ChatChunkChoice, ChatDelta, ChatLogprobs, ChatRequest,
                             ChatResponse, ChatResponseMessage, CompletionChoice, CompletionLogprobs,
                             CompletionRequest, CompletionResponse, ServerOptions, Usage, new_id)
from engine.scheduler import Request

log = logging.getLogger("moetune")

DISCONNECT_POLL_S = 0.5  # how often a non-streaming request checks that its client is still there
SHUTDOWN_MARGIN_S = 3.0  # time left in the shutdown grace period for closing once requests are cancelled


# ---------------------------------------------------------------- requests → engine


def _prompt_list(prompt) -> list:
    """The request's prompts: one text or token-id list, or a list of them."""
    return prompt if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)) else [prompt]


def _prompt_ids(llm: LLM, prompts: list) -> list[list[int]]:
    try:
        return [llm._encode(p) for p in prompts]
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


def _sampling(llm: LLM, body, prompts: list[list[int]], default_max: int | None, logprobs: int | None = None,
              prompt_logprobs: int | None = None) -> SamplingParams:
    """Checked SamplingParams; the prompts are checked against the vocabulary and the context.
    max_tokens may be 0 only when the prompt's logprobs are asked for (scoring with echo)."""
    max_tokens = getattr(body, "max_completion_tokens", None) or body.max_tokens
    if max_tokens is None:
        max_tokens = default_max if default_max is not None else llm.max_context - max(map(len, prompts))
    least = 0 if prompt_logprobs is not None else 1
    if max_tokens < least:
        raise ApiError(400, f"max_tokens must be at least 1 (0 with echo and logprobs), got {max_tokens}",
                       "max_tokens")
    if any(not s for s in body.stop_list):
        raise ApiError(400, "stop strings must not be empty", "stop")
    for ids in prompts:
        try:
            llm._check_prompt(ids, max_tokens)
        except MoetuneError as e:
            code = "context_length_exceeded" if "context" in str(e) else None
            param = "max_tokens" if code and len(ids) < llm.max_context else "prompt"
            raise ApiError(400, str(e), param, code) from None
    return SamplingParams(max_tokens=max_tokens, temperature=1.0 if body.temperature is None else body.temperature,
                          top_p=1.0 if body.top_p is None else body.top_p, top_k=max(0, body.top_k or 0),
                          seed=body.seed, stop=body.stop_list, ignore_eos=body.ignore_eos, logprobs=logprobs,
                          prompt_logprobs=prompt_logprobs)


def _sample_params(params: SamplingParams, j: int) -> SamplingParams:
    """Sample j of a prompt: its own seed (sample 0 keeps the request's: it equals an n = 1 request),
    no prompt logprobs (the first sample's are shared)."""
    if j == 0:
        return params
    seed = None if params.seed is None else (params.seed + j * 0x9E3779B97F4A7C15) % (1 << 63)
    return replace(params, seed=seed, prompt_logprobs=None)


def _stable(text: str, stops: list[str]) -> str:
    """What may be streamed of an unfinished text: not a trailing partial UTF-8 character, nor a
    tail that could still grow into a stop string (it would be cut from the final text)."""
    text = text.rstrip("\ufffd")
    hold = max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
    return text[: len(text) - hold]


class Generation:
    """One HTTP request's sequences through the engine, seen from the event loop: `samples` per
    prompt, sequence i being sample i % samples of prompt i // samples. The samples of a prompt
    share its prefill (the first holds the others as forks: engine/scheduler.py)."""

    def __init__(self, engine: EngineThread, prompts: list[list[int]], params: SamplingParams, samples: int,
                 timeout: float | None = None):
        self.engine, self.params, self.samples = engine, params, samples
        self.reqs: list[Request] = []
        for ids in prompts:
            first = Request(RequestOutput(ids), params)
            first.forks = [Request(RequestOutput(ids), _sample_params(params, j), parent=first)
                           for j in range(1, samples)]
            self.reqs += [first, *first.forks]
        self.events: asyncio.Queue[tuple[int, TokenEvent]] = asyncio.Queue()
        self.finals: dict[int, TokenEvent] = {}
        loop = asyncio.get_running_loop()
        self.timeout, self.deadline = timeout, loop.time() + timeout if timeout else None
        engine.submit(self.reqs, lambda i, ev: loop.call_soon_threadsafe(self.events.put_nowait, (i, ev)))

    @property
    def done(self) -> bool:
        return len(self.finals) == len(self.reqs)

    @property
    def prompt_tokens(self) -> int:
        return sum(len(r.out.prompt_token_ids) for r in self.reqs[::self.samples])

    @property
    def completion_tokens(self) -> int:
        return sum(ev.num_tokens for ev in self.finals.values())

    def prompt_logprobs(self, i: int) -> list:
        """Sequence i's prompt logprobs (complete once it has had an event)."""
        return self.reqs[i - i % self.samples].out.prompt_logprobs

    def cancel(self) -> None:
        for i, r in enumerate(self.reqs):
            if i not in self.finals:
                self.engine.cancel(r)

    async def _next(self, http: HttpRequest | None = None) -> tuple[int, TokenEvent]:
        """The next event; an ApiError when the request times out or the engine failed it, and
        (given `http`) when the client has gone."""
        loop = asyncio.get_running_loop()
        while True:
            wait = DISCONNECT_POLL_S if http is not None else None
            if self.deadline is not None:
                left = self.deadline - loop.time()
                if left <= 0:
                    raise ApiError(408, f"the request did not finish within {self.timeout:g} s (--request-timeout)",
                                   code="timeout")
                wait = left if wait is None else min(wait, left)
            try:
                i, ev = await asyncio.wait_for(self.events.get(), wait)
            except asyncio.TimeoutError:
                if http is not None and await http.is_disconnected():
                    raise ApiError(400, "the client disconnected") from None
                continue
            if ev.finish_reason is not None:
                self.finals[i] = ev
            if ev.error:
                raise ApiError(503 if ev.finish_reason == "abort" else 500, ev.error)
            return i, ev

    async def deltas(self) -> AsyncIterator[tuple[int, str, TokenEvent, list]]:
        """(sequence, new text, event, logprobs of its new tokens) per step until every sequence is
        finished; each sequence's texts add up to its final text."""
        sent, counts = [""] * len(self.reqs), [0] * len(self.reqs)
        while not self.done:
            i, ev = await self._next()
            text = ev.text if ev.finish_reason else _stable(ev.text, self.params.stop_strings)
            delta = text[len(sent[i]):] if text.startswith(sent[i]) else ""
            sent[i] += delta
            new, counts[i] = list(ev.logprobs[counts[i]:ev.num_tokens]), ev.num_tokens
            yield i, delta, ev, new

    async def result(self, http: HttpRequest) -> list[TokenEvent]:
        """Every sequence's final event, cancelling them all if the client disconnects first."""
        try:
            while not self.done:
                await self._next(http)
            return [self.finals[i] for i in range(len(self.reqs))]
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
        self.texts = TokenTexts(llm.tokenizer)
        self.draining = False

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
        raw = _prompt_list(body.prompt)
        prompts = _prompt_ids(self.llm, raw)
        samples, k = body.best_of or body.n, body.logprobs
        if samples < body.n:
            raise ApiError(400, f"best_of ({samples}) must be at least n ({body.n})", "best_of")
        if body.stream and samples > body.n:
            raise ApiError(400, "best_of > n cannot be streamed", "best_of")
        ranked = samples > body.n  # best_of: the n samples of highest cumulative logprob are returned
        params = _sampling(self.llm, body, prompts, default_max=16, logprobs=0 if ranked and k is None else k,
                           prompt_logprobs=k if body.echo and k is not None else None)
        gen = self.generation(prompts, params, samples)
        rid, created = new_id("cmpl")
        echo = [(p if isinstance(p, str) else self.llm._decode(p)) if body.echo else "" for p in raw]

        def logprobs(i: int, entries: list, offset: int, first: bool) -> CompletionLogprobs | None:
            """Sequence i's new entries; the echoed prompt's with its first chunk."""
            if k is None:
                return None
            lp = None
            if first and body.echo:
                ids = prompts[i // samples]
                lp = completion_logprobs(self.texts, ids, gen.prompt_logprobs(i), offset)
                offset = lp.text_offset[-1] + len(lp.tokens[-1])
            return completion_logprobs(self.texts, [e.token for e in entries], entries, offset, into=lp)

        if not body.stream:
            finals = await gen.result(http)
            choices = []
            for p in range(len(prompts)):
                group = range(p * samples, (p + 1) * samples)
                if ranked:
                    group = sorted(group, key=lambda i: -finals[i].cumulative_logprob)[: body.n]
                for i in group:
                    ev = finals[i]
                    choices.append(CompletionChoice(index=len(choices), text=echo[p] + ev.text, finish_reason=ev.finish_reason,
                                                    logprobs=logprobs(i, ev.logprobs[:ev.num_tokens], 0, True)))
            return CompletionResponse(id=rid, created=created, model=self.name, choices=choices,
                                      usage=Usage.of(gen.prompt_tokens, gen.completion_tokens))

        def chunk(choices: list[CompletionChoice], usage: Usage | None = None) -> str:
            return _sse(CompletionResponse(id=rid, created=created, model=self.name, choices=choices, usage=usage))

        async def chunks():  # one chunk per token (its text may be held back: see _stable)
            offsets, started = [0] * len(gen.reqs), [False] * len(gen.reqs)
            async for i, delta, ev, entries in gen.deltas():
                lp = logprobs(i, entries, offsets[i], not started[i])
                if lp is not None and lp.tokens:
                    offsets[i] = lp.text_offset[-1] + len(lp.tokens[-1])
                text = ("" if started[i] else echo[i // samples]) + delta
                started[i] = True
                yield chunk([CompletionChoice(index=i, text=text, logprobs=lp, finish_reason=ev.finish_reason)])

        return self._stream(gen, chunks(), lambda usage: chunk([], usage), body)

    # ------------------------------------------------------------ chat

    async def chat(self, body: ChatRequest, http: HttpRequest):
        self.check_model(body.model)
        if body.top_logprobs is not None and not body.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        prompts = [_chat_ids(self.llm, body)]
        k = (body.top_logprobs or 0) if body.logprobs else None
        gen = self.generation(prompts, _sampling(self.llm, body, prompts, default_max=None, logprobs=k), body.n)
        rid, created = new_id("chatcmpl")

        def logprobs(entries: list) -> ChatLogprobs | None:
            return None if k is None else chat_logprobs(self.texts, entries)

        if not body.stream:
            finals = await gen.result(http)
            choices = [ChatChoice(index=i, message=ChatResponseMessage(content=ev.text), finish_reason=ev.finish_reason,
                                  logprobs=logprobs(ev.logprobs[:ev.num_tokens])) for i, ev in enumerate(finals)]
            return ChatResponse(id=rid, created=created, model=self.name, choices=choices,
                                usage=Usage.of(gen.prompt_tokens, gen.completion_tokens))

        def chunk(choices: list[ChatChunkChoice], usage: Usage | None = None) -> str:
            return _sse(ChatChunk(id=rid, created=created, model=self.name, choices=choices, usage=usage))

        async def chunks():
            for i in range(len(gen.reqs)):
                yield chunk([ChatChunkChoice(index=i, delta=ChatDelta(role="assistant", content=""))])
            async for i, delta, ev, entries in gen.deltas():  # one chunk per token, as for completions
                yield chunk([ChatChunkChoice(index=i, delta=ChatDelta(content=delta), logprobs=logprobs(entries),
                                             finish_reason=ev.finish_reason)])

        return self._stream(gen, chunks(), lambda usage: chunk([], usage), body)

    def generation(self, prompts: list[list[int]], params: SamplingParams, samples: int) -> Generation:
        """The request's sequences, queued, once they are within the limits (ServerOptions)."""
        o = self.options
        if len(prompts) > o.max_prompts:
            raise ApiError(400, f"{len(prompts)} prompts in one request: at most {o.max_prompts} (--max-prompts)",
                           "prompt")
        tokens = sum(len(ids) + params.max_tokens for ids in prompts) * samples
        if tokens > o.max_request_tokens:
            raise ApiError(400, f"the request asks for {tokens} tokens ((prompt + max_tokens) x samples): at most "
                                f"{o.max_request_tokens} (--max-request-tokens)", "max_tokens")
        return Generation(self.engine, prompts, params, samples, o.request_timeout or None)

    def drain(self) -> None:
        """SIGTERM / SIGINT: refuse new requests (503); cancel those still running SHUTDOWN_MARGIN_S
        before the grace period ends (a third of it when it is shorter than 3 × that margin; a
        stream ends with an error event and [DONE]), so that uvicorn, which waits for them, and
        the process exit finish within it."""
        if self.draining:
            return
        self.draining = True
        grace = self.options.shutdown_grace
        log.info("shutting down: running requests have %g s to finish", grace)
        timer = threading.Timer(grace - min(grace / 3, SHUTDOWN_MARGIN_S), self.engine.abort_all)
        timer.daemon = True
        timer.start()

    def _stream(self, gen: Generation, chunks, usage_chunk, body) -> StreamingResponse:
        include_usage = body.stream_options is not None and body.stream_options.include_usage

        async def events():
            try:
                async for text in chunks:
                    yield text
                if include_usage:
                    yield usage_chunk(Usage.of(gen.prompt_tokens, gen.completion_tokens))
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

    def __init__(self, app, server: Server):
        self.app, self.server, self.options = app, server, server.options
        self.keys = [k.encode() for k in self.options.api_keys]

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
        if self.server.draining and scope["path"] != "/health":
            return await _error(ApiError(503, "the server is shutting down"))(scope, receive, send)
        limit = self.options.max_body_bytes
        length = next((v for k, v in scope.get("headers", ()) if k == b"content-length"), b"0")
        if int(length or 0) > limit:
            return await _error(_too_large(limit))(scope, receive, send)
        scope.setdefault("state", {})["authenticated"] = authed
        await self.app(scope, _counted(receive, limit), send)


def _too_large(limit: int) -> ApiError:
    return ApiError(413, f"the request body is larger than {limit} bytes (--max-body-bytes)",
                    code="request_too_large")


def _counted(receive, limit: int):
    """receive, failing with 413 once the body passes `limit` bytes (a body sent without a length)."""
    seen = 0

    async def counted():
        nonlocal seen
        message = await receive()
        seen += len(message.get("body", b""))
        if seen > limit:
            raise StarletteHTTPException(413, _too_large(limit).message)
        return message

    return counted


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
        return _error(ApiError(exc.status_code, str(exc.detail), code="request_too_large" if exc.status_code == 413 else None))

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
    app.add_middleware(Gate, server=server)
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
    for flag in ("max_body_bytes", "max_prompts", "max_request_tokens"):
        if getattr(args, flag) < 1:
            raise MoetuneError(f"--{flag.replace('_', '-')} must be at least 1, got {getattr(args, flag)}")
    for flag in ("request_timeout", "shutdown_grace"):
        if getattr(args, flag) < 0:
            raise MoetuneError(f"--{flag.replace('_', '-')} must not be negative, got {getattr(args, flag)}")
    return ServerOptions(api_keys=keys, metrics_public=args.metrics_public, loopback=_is_loopback(args.host),
                         max_body_bytes=args.max_body_bytes, max_prompts=args.max_prompts,
                         max_request_tokens=args.max_request_tokens, request_timeout=args.request_timeout,
                         shutdown_grace=args.shutdown_grace)


def _graceful_uvicorn(config, server: Server):
    """uvicorn's server with moetune's shutdown: on SIGTERM or SIGINT it stops accepting connections,
    gives the running requests the grace period (Server.drain) and exits 0 (plain uvicorn re-raises
    the signal once it has shut down); a second SIGINT quits at once."""
    import uvicorn

    class Graceful(uvicorn.Server):
        def handle_exit(self, sig, frame):
            if self.should_exit and sig == signal.SIGINT:
                self.force_exit = True
            self.should_exit = True
            server.drain()

    return Graceful(config)


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
    app = create_app(llm, name, options)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="warning", access_log=False,
                            timeout_graceful_shutdown=options.shutdown_grace + 5)  # a backstop: drain() ends them first
    _graceful_uvicorn(config, app.state.server).run()
    log.info("stopped")
    return 0

"""The web layer of `linearize serve`: OpenAI's completions and chat completions over an `Engine`.

    app = create_app(engine, tokenizer, "my-model", max_prompt_tokens=32768)   # then uvicorn.run(app)

A request is validated (`schemas`), tokenized, and submitted to the engine from the event loop; its
tokens come back through `Request.tokens()` and leave as text (`detokenize.TextStream`), in one
response or as server-sent events. Every failure answers in OpenAI's error format: 400 for a bad
request, 404 for an unknown model or path, 429 when the engine's queue is full, 503 while it shuts
down, 500 for a fault of the server's own, which then goes on serving. A client that goes away cancels
its request, which frees its slot.

A prompt is refused by its size before it is tokenized (`_Served.max_prompt_chars`: no prompt of more
characters can fit `max_prompt_tokens`), and tokenized on a worker thread, so that a huge prompt
neither takes the tokenizer's time nor holds up the event loop's other requests.

A completion's `prompt` may be a batch of several: each is checked, then submitted as a request of its
own, and the answer holds one choice a prompt, in order. Completions take `logprobs` and `echo`, chat
`logprobs` and `top_logprobs` (`logprob_bodies` spells them out); `GET /metrics` gives the counts of
`metrics.ServeMetrics` in Prometheus's text format.

`app.state.shutdown` (`Shutdown`) is how the process stops it: `drain()` answers every new request
503 while the ones in flight finish; `force()` ends those too (a stream gets an error event and
`[DONE]`); `idle` says when none is left.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from transformers import PreTrainedTokenizerBase

from ..cli_args import first_line
from .detokenize import TextStream
from .engine import Engine, EngineStopped, QueueFull, SamplingParams, TooLarge
from .logprob_bodies import TokenTexts, chat_logprobs, completion_logprobs
from .metrics import ServeMetrics
from .prometheus import CONTENT_TYPE as METRICS_CONTENT_TYPE
from .schemas import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    ErrorDetail,
    ErrorResponse,
    ModelCard,
    ModelList,
    Usage,
)

log = logging.getLogger("linearize.serve")

DEFAULT_MAX_COMPLETION_TOKENS = 4096
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat's is the server's cap
_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}  # no proxy should hold events back


class APIError(Exception):
    """An answer in OpenAI's error format, raised anywhere a request is handled."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status = status
        self.detail = ErrorDetail(message=message, type=type, param=param, code=code)


class _Interrupted(Exception):
    """The engine ended a request that neither its client nor its stop strings ended."""


def error_response(status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                   code: str | None = None) -> JSONResponse:
    body = ErrorResponse(error=ErrorDetail(message=message, type=type, param=param, code=code))
    return JSONResponse(body.model_dump(), status_code=status)


def create_app(engine: Engine, tokenizer: PreTrainedTokenizerBase, model_name: str, max_prompt_tokens: int, *,
               max_completion_tokens: int = DEFAULT_MAX_COMPLETION_TOKENS) -> FastAPI:
    """The server's app over a started `engine` (`linearize.serve.engine.Engine`); its shutdown drains the
    engine (`engine.stop(drain=True)`) and sets `app.state.engine_stopped`."""
    served = _Served(engine, tokenizer, model_name, max_prompt_tokens, max_completion_tokens)
    shutdown = Shutdown(engine)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        # uvicorn gets here once the requests in flight have ended; the engine finishes any left over.
        # In a thread: a request still being drained delivers its tokens through this loop.
        await asyncio.to_thread(engine.stop, True)
        served.close()
        app.state.engine_stopped = True

    app = FastAPI(title="linearize serve", summary=f"OpenAI-compatible API over {model_name}", lifespan=lifespan)
    app.state.engine_stopped = False
    app.state.shutdown = shutdown
    app.add_middleware(_ShutdownGate, shutdown=shutdown)
    _add_error_handlers(app)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: HTTPRequest):
        served.check_model(body.model)
        prompts = [await served.completion_prompt(prompt) for prompt in body.prompt]
        max_tokens = served.max_tokens(body.max_tokens, COMPLETIONS_DEFAULT_MAX_TOKENS, "max_tokens")
        echoed = [(prompt if isinstance(prompt, str) else await served.decode(ids)) if body.echo else ""
                  for prompt, ids in zip(body.prompt, prompts, strict=True)]
        generations = served.submit_all(prompts, body, max_tokens, logprobs=body.logprobs,
                                        prompt_logprobs=body.logprobs if body.echo else None)
        if body.stream:  # one prompt (schemas refuse to stream a batch)
            return _event_stream(raw, generations[0], _CompletionChunks(served.name, body.include_usage, echoed[0]))
        texts = await _collect(raw, generations)
        choices = []
        for index, (generation, ids, echo, text) in enumerate(zip(generations, prompts, echoed, texts, strict=True)):
            logprobs = None
            if body.logprobs is not None:
                tokens, entries = generation.scored_tokens()
                if body.echo:
                    tokens, entries = ids + tokens, generation.request.prompt_logprobs + entries
                logprobs = await served.off_loop(completion_logprobs, tokens, entries, served.token_texts)
            choices.append(CompletionChoice(index=index, text=echo + text, logprobs=logprobs,
                                            finish_reason=generation.finish_reason))
        usages = [generation.usage() for generation in generations]
        usage = Usage(**{field: sum(getattr(u, field) for u in usages) for field in Usage.model_fields})
        return CompletionResponse(id=generations[0].id("cmpl"), created=generations[0].created, model=served.name,
                                  choices=choices, usage=usage)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, raw: HTTPRequest):
        served.check_model(body.model)
        served.check_size(sum(len(m.text()) for m in body.messages), "messages")
        prompt_ids = await served.encode(await served.chat_prompt(body), add_special_tokens=False)
        param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        max_tokens = served.max_tokens(body.requested_tokens, served.max_completion_tokens, param)
        generation = served.submit(prompt_ids, body, max_tokens,
                                   logprobs=(body.top_logprobs or 0) if body.logprobs else None)
        if body.stream:
            return _event_stream(raw, generation, _ChatChunks(served.name, body.include_usage))
        [text] = await _collect(raw, [generation])
        logprobs = None
        if body.logprobs:
            logprobs = await served.off_loop(chat_logprobs, generation.scored_tokens()[1], served.token_texts)
        choice = ChatChoice(message=AssistantMessage(content=text), logprobs=logprobs,
                            finish_reason=generation.finish_reason)
        return ChatCompletionResponse(id=generation.id("chatcmpl"), created=generation.created, model=served.name,
                                      choices=[choice], usage=generation.usage())

    @app.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=served.name, created=served.created)])

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", **engine.stats()}

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(served.metrics.exposition(), media_type=METRICS_CONTENT_TYPE)

    return app


class Shutdown:
    """How the server stops: `drain()` refuses new requests (503) while those in flight finish; `force()`
    cancels those in flight too, so that each ends at once with an error (a stream: an error event, then
    `[DONE]`). `in_flight` counts the HTTP requests being answered; `idle` once draining and none is left."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.draining = self.forced = False
        self.in_flight = 0

    def drain(self) -> None:
        self.draining = True

    def force(self) -> None:
        self.draining = self.forced = True
        self.engine.cancel_all()

    @property
    def idle(self) -> bool:
        return self.draining and self.in_flight == 0


class _ShutdownGate:
    """ASGI middleware: counts the requests in flight and, while the server drains, answers every new one
    503 in OpenAI's format (and closes its connection), so that a client is told rather than refused."""

    def __init__(self, app, shutdown: Shutdown):
        self.app, self.shutdown = app, shutdown

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.shutdown.draining:
            body = ErrorResponse(error=ErrorDetail(message="the server is shutting down: no new requests",
                                                   type="service_unavailable_error", code="shutting_down"))
            payload = json.dumps(body.model_dump()).encode()
            await send({"type": "http.response.start", "status": 503,
                        "headers": [(b"content-type", b"application/json"), (b"connection", b"close"),
                                    (b"content-length", str(len(payload)).encode())]})
            await send({"type": "http.response.body", "body": payload})
            return
        self.shutdown.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.shutdown.in_flight -= 1


class _Served:
    """What every request needs: the engine, the tokenizer, the served name and the limits."""

    def __init__(self, engine: Engine, tokenizer: PreTrainedTokenizerBase, name: str, max_prompt_tokens: int,
                 max_completion_tokens: int):
        if max_prompt_tokens < 1 or max_completion_tokens < 1:
            raise ValueError("max_prompt_tokens and max_completion_tokens must be >= 1")
        self.engine, self.tokenizer, self.name = engine, tokenizer, name
        self.max_prompt_tokens, self.max_completion_tokens = max_prompt_tokens, max_completion_tokens
        self.vocab_size = len(tokenizer)
        # No token spells more characters than the vocabulary's longest entry (a byte-level one spells a
        # byte a character, a byte-fallback one more characters than bytes), so no prompt longer than
        # this can fit `max_prompt_tokens`.
        self.longest_token_chars = max((len(t) for t in tokenizer.get_vocab()), default=1)
        self.max_prompt_chars = max_prompt_tokens * max(1, self.longest_token_chars)
        # One worker: the tokenizer's calls run one at a time, off the event loop.
        self._tokenizing = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="linearize-tokenize")
        self.created = int(time.time())
        self.token_texts = TokenTexts(tokenizer)
        self.metrics = ServeMetrics(name, engine.stats)

    def close(self) -> None:
        self._tokenizing.shutdown(wait=False, cancel_futures=True)

    async def off_loop(self, function, *args, **kwargs):
        """`function(*args, **kwargs)` on the tokenizer's worker thread (what decodes or encodes runs there)."""
        return await asyncio.get_running_loop().run_in_executor(self._tokenizing, lambda: function(*args, **kwargs))

    def check_model(self, model: str) -> None:
        if model != self.name:
            raise APIError(404, f"The model `{model}` does not exist: this server serves `{self.name}`",
                           param="model", code="model_not_found")

    def check_size(self, chars: int, param: str) -> None:
        """Refuse, before tokenizing, a prompt of more characters than `max_prompt_tokens` can hold."""
        if chars > self.max_prompt_chars:
            raise APIError(400, f"the {param} has {chars} characters, more than {self.max_prompt_tokens} tokens can "
                           f"hold ({self.max_prompt_chars}: at most {self.longest_token_chars} a token for this "
                           f"tokenizer); this server takes at most {self.max_prompt_tokens} tokens", param=param,
                           code="context_length_exceeded")

    async def chat_prompt(self, body: ChatCompletionRequest) -> str:
        if not getattr(self.tokenizer, "chat_template", None):
            raise APIError(400, f"`{self.name}` has no chat template: use /v1/completions", param="messages")
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        try:
            return await self.off_loop(self.tokenizer.apply_chat_template, messages, tokenize=False,
                                        add_generation_prompt=True)
        except Exception as e:  # noqa: BLE001 (templates raise what they like: jinja's TemplateError, TypeError, ...)
            reason = first_line(e)
            raise APIError(400, f"the chat template refused these messages: {reason}", param="messages") from None

    async def encode(self, text: str, *, add_special_tokens: bool) -> list[int]:
        ids = await self.off_loop(self.tokenizer.encode, text, add_special_tokens=add_special_tokens)
        if not ids:
            raise APIError(400, "the prompt gives no tokens to continue from", param="prompt")
        return self._check_length(ids)

    async def completion_prompt(self, prompt: str | list[int]) -> list[int]:
        """A completion prompt's token ids: a text tokenized with the tokenizer's special tokens, ids checked."""
        if isinstance(prompt, str):
            self.check_size(len(prompt), "prompt")
            return await self.encode(prompt, add_special_tokens=True)
        return self.check_token_ids(prompt)

    async def decode(self, ids: list[int]) -> str:
        return await self.off_loop(self.tokenizer.decode, ids)

    def check_token_ids(self, ids: list[int]) -> list[int]:
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise APIError(400, f"token id {bad} is not in the vocabulary (0 to {self.vocab_size - 1})", param="prompt")
        return self._check_length(ids)

    def _check_length(self, ids: list[int]) -> list[int]:
        if len(ids) > self.max_prompt_tokens:
            raise APIError(400, f"the prompt has {len(ids)} tokens; this server takes at most {self.max_prompt_tokens}",
                           param="prompt", code="context_length_exceeded")
        return ids

    def max_tokens(self, asked: int | None, default: int, param: str) -> int:
        if asked is None:
            return min(default, self.max_completion_tokens)
        if asked > self.max_completion_tokens:
            raise APIError(400, f"{param} is {asked}; this server generates at most {self.max_completion_tokens} "
                           "tokens a request", param=param)
        return asked

    def submit(self, prompt_ids: list[int], body, max_tokens: int, *, logprobs: int | None = None,
               prompt_logprobs: int | None = None) -> _Generation:
        params = SamplingParams(max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p, seed=body.seed,
                                ignore_eos=body.ignore_eos, logprobs=logprobs, prompt_logprobs=prompt_logprobs)
        try:
            request = self.engine.submit(prompt_ids, params)
        except TooLarge as e:
            raise APIError(400, str(e), param="max_tokens", code="context_length_exceeded") from None
        except QueueFull as e:
            raise APIError(429, f"the server is busy: {e}; retry later", type="rate_limit_error",
                           code="queue_full") from None
        except EngineStopped as e:
            raise APIError(503, f"{e}: no new requests", type="service_unavailable_error",
                           code="shutting_down") from None
        self.metrics.request_started(len(prompt_ids))
        return _Generation(request, TextStream(self.tokenizer, body.stop), len(prompt_ids), self.metrics)

    def submit_all(self, prompts: list[list[int]], body, max_tokens: int, **logprobs) -> list[_Generation]:
        """`submit` each prompt; if one is refused, the ones before it are cancelled and the refusal raised."""
        generations: list[_Generation] = []
        try:
            for prompt_ids in prompts:
                generations.append(self.submit(prompt_ids, body, max_tokens, **logprobs))
        except BaseException:
            for generation in generations:
                generation.abandon()
            raise
        return generations


class _Generation:
    """One submitted request seen from the web side: its text as it comes, why it ended, its counts."""

    def __init__(self, request, text: TextStream, prompt_tokens: int, metrics: ServeMetrics):
        self.request, self.text, self.prompt_tokens, self.metrics = request, text, prompt_tokens, metrics
        self.created = int(time.time())
        self.submitted = self._last_token = time.perf_counter()
        self.finish_reason: str | None = None
        self._id = uuid.uuid4().hex

    def id(self, prefix: str) -> str:
        return f"{prefix}-{self._id}"

    def usage(self) -> Usage:
        return Usage(prompt_tokens=self.prompt_tokens, completion_tokens=self.text.tokens,
                     total_tokens=self.prompt_tokens + self.text.tokens)

    def scored_tokens(self) -> tuple[list[int], list]:
        """The tokens the text was made of and their log-probabilities (`logprobs.TokenLogprob`), for a
        request that asked for them: a stop string's tokens included, any the engine made after it not."""
        tokens = self.request.generated[:self.text.tokens]
        return tokens, self.request.logprobs[:len(tokens)]

    async def pieces(self) -> AsyncIterator[str]:
        """The text, piece by piece; `finish_reason` is set once it ends. Raises `_Interrupted` if the
        engine cancelled the request, RuntimeError if the engine failed on it."""
        try:
            async for token in self.request.tokens():
                now = time.perf_counter()
                self.metrics.token(now - self._last_token, first=self.text.tokens == 0)
                self._last_token = now
                if piece := self.text.push(token):
                    yield piece
                if self.text.stopped:
                    self.request.cancel()  # the rest would be cut anyway: free the slot now
                    self._finished("stop")
                    return
            if self.request.finish_reason not in ("stop", "length"):
                raise _Interrupted(f"the request ended early ({self.request.finish_reason}): the server is stopping")
            if piece := self.text.finish():
                yield piece
            self._finished("stop" if self.text.stopped else self.request.finish_reason)
        finally:
            self.abandon()

    def _finished(self, reason: str) -> None:
        self.finish_reason = reason
        self.metrics.request_finished(reason, time.perf_counter() - self.submitted)

    def abandon(self) -> None:
        """Cancel the request unless it ended: its client left, or its task was cancelled. The slot frees."""
        if self.finish_reason is None:
            self.request.cancel()


async def _cancel_on_disconnect(raw: HTTPRequest, generations: list[_Generation]) -> None:
    """Wait for the client to go away, then cancel its requests. The body is read already, so the next
    message the server passes on is the disconnect."""
    while (await raw.receive())["type"] != "http.disconnect":
        pass
    for generation in generations:
        generation.abandon()


async def _text(generation: _Generation) -> str:
    return "".join([piece async for piece in generation.pieces()])


async def _collect(raw: HTTPRequest, generations: list[_Generation]) -> list[str]:
    """The whole text of each generation, generated side by side. Every one runs to its end, so that a
    failure is answered once all are done, with the first one's error."""
    watcher = asyncio.create_task(_cancel_on_disconnect(raw, generations))
    try:
        texts = await asyncio.gather(*(_text(generation) for generation in generations), return_exceptions=True)
    finally:
        watcher.cancel()
        for generation in generations:
            generation.abandon()
    failure = next((t for t in texts if isinstance(t, BaseException)), None)
    if isinstance(failure, _Interrupted):
        raise APIError(503, str(failure), type="service_unavailable_error", code="shutting_down")
    if isinstance(failure, RuntimeError):  # the engine failed on this request (Request.tokens)
        raise APIError(500, f"the model failed on this request: {failure}", type="server_error")
    if failure is not None:
        raise failure
    return texts


class _CompletionChunks:
    """The events of a streamed completion."""

    def __init__(self, model: str, include_usage: bool, echoed: str = ""):
        self.model, self.include_usage, self.echoed = model, include_usage, echoed

    def start(self, generation: _Generation) -> list[BaseModel]:
        return [self.text(generation, self.echoed)] if self.echoed else []

    def text(self, generation: _Generation, piece: str, finish_reason: str | None = None) -> BaseModel:
        return CompletionResponse(id=generation.id("cmpl"), created=generation.created, model=self.model,
                                  choices=[CompletionChoice(text=piece, finish_reason=finish_reason)])

    def end(self, generation: _Generation) -> list[BaseModel]:
        chunks = [self.text(generation, "", generation.finish_reason)]
        if self.include_usage:  # as OpenAI's: one more chunk, with no choices
            chunks.append(CompletionResponse(id=generation.id("cmpl"), created=generation.created, model=self.model,
                                             choices=[], usage=generation.usage()))
        return chunks


class _ChatChunks:
    """The events of a streamed chat completion: the role first, then the content, then the finish reason."""

    def __init__(self, model: str, include_usage: bool):
        self.model, self.include_usage = model, include_usage

    def _chunk(self, generation: _Generation, choices: list[ChatChunkChoice], usage: Usage | None = None):
        return ChatCompletionChunk(id=generation.id("chatcmpl"), created=generation.created, model=self.model,
                                   choices=choices, usage=usage)

    def start(self, generation: _Generation) -> list[BaseModel]:
        return [self._chunk(generation, [ChatChunkChoice(delta=ChatDelta(role="assistant", content=""))])]

    def text(self, generation: _Generation, piece: str) -> BaseModel:
        return self._chunk(generation, [ChatChunkChoice(delta=ChatDelta(content=piece))])

    def end(self, generation: _Generation) -> list[BaseModel]:
        chunks = [self._chunk(generation, [ChatChunkChoice(delta=ChatDelta(), finish_reason=generation.finish_reason)])]
        if self.include_usage:
            chunks.append(self._chunk(generation, [], generation.usage()))
        return chunks


def _event(body: BaseModel) -> str:
    return f"data: {body.model_dump_json()}\n\n"


def _event_stream(raw: HTTPRequest, generation: _Generation, chunks) -> StreamingResponse:
    async def events() -> AsyncIterator[str]:
        watcher = asyncio.create_task(_cancel_on_disconnect(raw, [generation]))
        try:
            for chunk in chunks.start(generation):
                yield _event(chunk)
            async for piece in generation.pieces():
                yield _event(chunks.text(generation, piece))
            for chunk in chunks.end(generation):
                yield _event(chunk)
        except _Interrupted as e:
            yield _event(ErrorResponse(error=ErrorDetail(message=str(e), type="service_unavailable_error",
                                                         code="shutting_down")))
        except Exception as e:  # the status line is sent: an error event is all the client can get
            log.exception("stream of request %s failed", generation.id("req"))
            message = f"the model failed on this request: {e}" if isinstance(e, RuntimeError) else \
                "the server failed on this request"
            yield _event(ErrorResponse(error=ErrorDetail(message=message, type="server_error")))
        finally:
            # Also when the response is dropped between events, with `pieces` suspended and not closed.
            watcher.cancel()
            generation.abandon()
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream", headers=_SSE_HEADERS)


# Union members' tags that pydantic puts in an error's location after the field (`content.str`).
_TYPE_TAGS = {"str", "int", "float", "bool", "none", "list", "dict"}


def _validation_message(error: dict) -> tuple[str, str | None]:
    """One line and the parameter it is about, from pydantic's first error."""
    path = [str(part) for part in error["loc"][1:]  # [0] is "body"
            if isinstance(part, int) or (part.isidentifier() and part not in _TYPE_TAGS)]
    ctx = error.get("ctx") or {}
    param = ctx.get("param") or ".".join(path) or None
    kind = error["type"]
    if kind == "json_invalid":
        return f"the body is not valid JSON ({ctx.get('error', 'parse error')})", None
    if param is None and kind == "missing":
        return "the request has no body: send a JSON object", None
    if param is None and kind in ("model_attributes_type", "dict_type", "model_type"):
        if isinstance(error.get("input"), bytes | str):  # a body FastAPI did not parse: not sent as JSON
            return "the body must be a JSON object, sent with Content-Type: application/json", None
        return "the body must be a JSON object", None
    if kind == "missing":
        return f"missing required field: {param}", param
    message = error["msg"]
    if param and not message.startswith(param.rsplit(".", 1)[-1]):  # our own messages name their field
        message = f"{param}: {message}"
    return message, param


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: HTTPRequest, exc: APIError) -> JSONResponse:
        return JSONResponse(ErrorResponse(error=exc.detail).model_dump(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: HTTPRequest, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        message, param = _validation_message(errors[0]) if errors else ("invalid request", None)
        return error_response(400, message, param=param)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: HTTPRequest, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            message = f"Invalid URL ({request.method} {request.url.path})"
        elif exc.status_code == 405:
            message = f"{request.method} is not allowed on {request.url.path}"
        else:
            message = str(exc.detail)
        return error_response(exc.status_code, message, type="invalid_request_error")

    @app.exception_handler(Exception)
    async def server_fault(request: HTTPRequest, exc: Exception) -> JSONResponse:
        log.exception("%s %s failed", request.method, request.url.path)
        return error_response(500, f"the server failed on this request ({type(exc).__name__})", type="server_error")

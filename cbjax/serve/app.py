"""The HTTP front: an aiohttp application over one `EngineLoop`.

Why aiohttp: one dependency that is both the server and (for tests and benchmarks) a
client, with the request handler's own coroutine writing each SSE event, so a stream
is a plain loop and a client that goes away is an exception in that loop (or, while
the request is still queued, a cancelled handler: `handler_cancellation=True`). Either
way the handler's `finally` aborts what the request still holds in the engine, which
frees its slot and pages. FastAPI/uvicorn would add pydantic models and an ASGI layer
for the same thing.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hmac
import logging
import threading
import time
import traceback

from aiohttp import web

from cbjax import Front
from cbjax.serve import protocol, responses
from cbjax.serve.admission import Admission
from cbjax.serve.choices import Choices
from cbjax.serve.connections import ConnectionGuard, GuardedSite, default_max_connections, quiet_accept_errors
from cbjax.serve.engine_loop import EngineLoop
from cbjax.serve.info_routes import InfoRoutes, json_response
from cbjax.serve.lora_routes import LoraRoutes
from cbjax.serve.prometheus import ServerMetrics
from cbjax.serve.protocol import APIError

log = logging.getLogger("cbjax.serve")


@web.middleware
async def _errors_as_json(request: web.Request, handler):
    """Every failure leaves as OpenAI's error body: ours, aiohttp's own (404, 405, 413), and
    any bug (500, logged) — the server goes on serving."""
    try:
        return await handler(request)
    except APIError as e:
        response = json_response(e.body(), e.status)
        response.headers.update(e.headers)
        return response
    except web.HTTPException as e:
        if e.status < 400:
            raise
        return json_response(APIError(e.status, e.reason or e.text or "error", type=_http_type(e.status)).body(),
                              e.status)
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception as e:
        log.error("internal error on %s %s:\n%s", request.method, request.path, traceback.format_exc())
        return json_response(APIError(500, f"internal error: {e}").body(), 500)


def _api_key_check(api_key: str):
    """A middleware refusing requests without `Authorization: Bearer <api_key>` (401 with
    OpenAI's body); /health stays open for load balancers. The comparison takes the same time
    whatever prefix of the key a caller guessed."""
    expected = f"Bearer {api_key}".encode()

    @web.middleware
    async def check(request: web.Request, handler):
        if request.path != "/health":
            given = request.headers.get("Authorization", "").encode("utf-8", "replace")
            if not hmac.compare_digest(given, expected):
                raise APIError(401, "Incorrect API key provided", type="authentication_error",
                               code="invalid_api_key")
        return await handler(request)

    return check


def _http_type(status: int) -> str:
    return {404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error"}.get(
        status, "invalid_request_error")


def _grammar_checked(llm, job: protocol.Job) -> protocol.Job:
    """A job whose grammar llguidance accepts (compiled on the parser threads: the engine's
    add_request then finds it compiled); else a 400 naming the field that asked for it."""
    if job.sampling.structured is not None:
        try:
            llm.grammars.compile(job.sampling.structured)
        except ValueError as e:
            raise protocol.bad(str(e), job.structured_field) from None
    return job


def _total(job, raw: bytes):
    """`job(parsed body)` for the parser threads. A StopIteration escaping it would never reach
    the handler (a Future refuses it as an exception, and the request would hang): a 500 instead."""
    def run():
        try:
            return job(protocol.parse_body(raw))
        except StopIteration as e:
            raise RuntimeError(f"StopIteration while parsing the request: {e!r}") from None
    return run


def _failure(out, job: protocol.Job, engine_error: str | None) -> APIError:
    """The error a failed request answers with: 500 once the engine loop is down, 400 naming the
    constraint's field when its matcher failed mid-generation, else 503."""
    if engine_error is not None:
        return APIError(500, out.error or "request failed")
    if job.structured_field is not None and (out.error or "").startswith("structured output"):
        return APIError(400, out.error, param=job.structured_field, code="structured_output_failed")
    return APIError(503, out.error or "request failed")


def _sink(loop, outputs: asyncio.Queue, index: int):
    """Where the engine loop hands prompt `index`'s outputs to the request's coroutine."""
    def put(output):
        loop.call_soon_threadsafe(outputs.put_nowait, (index, output))
    return put


class Server:
    """`Server(llm, model_name).start()` serves on a background thread (tests, benchmarks);
    `await server.serve()` / `server.run()` serve on the caller's loop (the CLI)."""

    def __init__(self, llm: Front, model_name: str, host: str = "127.0.0.1", port: int = 8000,
                 max_pending: int | None = None, max_body_bytes: int = 8 << 20, access_log: bool = False,
                 api_key: str | None = None, body_timeout_s: float = 30.0, max_pending_tokens: int | None = None,
                 max_logprob_entries: int | None = 1 << 18, max_connections: int | None = None,
                 header_timeout_s: float = 10.0, idle_timeout_s: float = 15.0):
        """`max_pending`: sequences (prompts x samples) held at once; `max_pending_tokens`: prompt
        tokens held at once; `max_logprob_entries`: prompt logprob entries one request may ask for
        (serve/admission.py). `max_connections` (default: below the descriptor limit),
        `header_timeout_s`, `idle_timeout_s` (keep-alive): serve/connections.py."""
        self.llm = llm
        self.body_timeout_s = body_timeout_s
        self.admission = Admission(max_pending, max_pending_tokens, max_logprob_entries)
        self.guard = ConnectionGuard(max_connections or default_max_connections(), header_timeout_s)
        self.idle_timeout_s = idle_timeout_s
        self.api_key = api_key
        # Bodies are parsed and prompts tokenized here, off the event loop (two: one huge prompt
        # does not hold up the next request's parse).
        self._parser = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="cbjax-parse")
        self.model_name = model_name
        self.adapters = list(llm.lora_adapters())  # the LoRA adapters `model` may name besides it
        self.host = host
        self.port = port
        self.max_body_bytes = max_body_bytes
        self.access_log = access_log
        self.metrics = ServerMetrics(model_name)
        self.engine = EngineLoop(llm, on_output=self.metrics.observe)
        self.created = int(time.time())
        self._runner: web.AppRunner | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    # -------------------------------------------------------------- life
    def app(self) -> web.Application:
        middlewares = [_errors_as_json] + ([_api_key_check(self.api_key)] if self.api_key else [])
        app = web.Application(middlewares=middlewares, client_max_size=self.max_body_bytes)
        GenerationRoutes(self).add_to(app)
        InfoRoutes(self).add_to(app)
        LoraRoutes(self).add_to(app)
        return app

    async def _start_site(self) -> None:
        self.engine.start()
        quiet_accept_errors(asyncio.get_running_loop())
        self._runner = web.AppRunner(self.app(), handler_cancellation=True, keepalive_timeout=self.idle_timeout_s,
                                    access_log=log if self.access_log else None)
        await self._runner.setup()
        await GuardedSite(self._runner, self.host, self.port, self.guard).start()
        self.port = self._runner.addresses[0][1]  # the bound port when asked for 0

    async def _shutdown(self) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self.engine.stop)
        if self._runner is not None:
            await self._runner.cleanup()
        self._parser.shutdown(wait=False, cancel_futures=True)

    async def serve(self) -> None:
        """Serve until cancelled (Ctrl-C under `asyncio.run`)."""
        await self._start_site()
        print(f"cbjax serving {self.model_name!r} on {self.url}", flush=True)
        try:
            await asyncio.Event().wait()
        finally:
            await self._shutdown()

    def run(self) -> None:
        try:
            asyncio.run(self.serve())
        except KeyboardInterrupt:
            pass

    def start(self) -> "Server":
        """Serve on a background thread; returns once the port is bound."""
        ready = threading.Event()
        failure: list[BaseException] = []

        def run():
            self._loop = asyncio.new_event_loop()
            try:
                self._loop.run_until_complete(self._start_site())
            except BaseException as e:  # e.g. the port is taken
                failure.append(e)
                ready.set()
                return
            ready.set()
            self._loop.run_forever()
            self._loop.run_until_complete(self._shutdown())
            self._loop.close()

        self._thread = threading.Thread(target=run, name="cbjax-http", daemon=True)
        self._thread.start()
        ready.wait()
        if failure:
            self.engine.stop()
            raise failure[0]
        return self

    def stop(self) -> None:
        if self._loop is not None and self._thread is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(30)

    def __enter__(self) -> "Server":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def served_models(self) -> tuple[str, ...]:
        """The names `model` may take: the base model's, then each loaded LoRA adapter's."""
        return (self.model_name, *self.adapters)

    @property
    def pending(self) -> int:
        """Sequences accepted and not finished."""
        return self.admission.samples

    async def off_loop(self, request: web.Request, job):
        """`job(body)` on the parser threads, `body` the request's parsed JSON. A body that
        does not arrive within `body_timeout_s` (a client that sent fewer bytes than its
        Content-Length, or trickles them) gets 408 instead of holding its connection forever."""
        try:
            raw = await asyncio.wait_for(request.read(), self.body_timeout_s)
        except asyncio.TimeoutError:
            raise APIError(408, f"the request body did not arrive within {self.body_timeout_s:g} s",
                           code="request_timeout") from None
        return await asyncio.get_running_loop().run_in_executor(self._parser, _total(job, raw))


class GenerationRoutes:
    """`/v1/completions` and `/v1/chat/completions`: a request's prompts x samples submitted to
    the engine loop, their outputs collected or streamed as SSE events, and whatever the
    request still holds aborted when it ends (a client gone, a refused sibling)."""

    def __init__(self, server: Server):
        self.server = server
        self.llm = server.llm
        self.model_name = server.model_name
        self.engine = server.engine
        self.admission = server.admission
        self.metrics = server.metrics

    def add_to(self, app: web.Application) -> None:
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, protocol.parse_completion)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, protocol.parse_chat)

    async def _parse(self, request: web.Request, parse):
        """The body parsed and its prompts tokenized on the parser threads, never on the event
        loop: a megabyte prompt takes the tokenizer seconds, which would stall every stream."""
        return await self.server.off_loop(request, lambda body: _grammar_checked(
            self.llm, parse(body, self.server.served_models(), self.llm.tokenizer, self.llm.max_model_len)))

    async def _generate(self, request: web.Request, parse) -> web.StreamResponse:
        received = self.llm.clock()
        job = await self._parse(request, parse)
        if not self.engine.alive:
            raise APIError(503, self.engine.error or "the engine loop is not running")
        n, cost = len(job.prompts), self.admission.cost(job)
        self.admission.admit(cost)
        loop = asyncio.get_running_loop()
        outputs: asyncio.Queue = asyncio.Queue()
        # The front names the requests, so it can abort one whose submission is still queued.
        response_id = responses.new_id(job)
        choices = Choices(job, self.llm.tokenizer, [f"{response_id}-{i}" for i in range(n)])
        try:
            futures = [self.engine.submit(prompt, job.sampling, _sink(loop, outputs, i), arrival_time=received,
                                          request_id=rid, priority=job.priority, lora=job.lora)
                       for i, (prompt, rid) in enumerate(zip(job.prompts, choices.request_ids))]
            for future in futures:
                try:
                    await asyncio.wrap_future(future)
                except ValueError as e:  # the engine's checks name the field (checks.FieldError)
                    raise protocol.bad(str(e), job.field_name(getattr(e, "field", None) or "prompt")) \
                        from None
                except RuntimeError as e:
                    raise APIError(503, str(e)) from None
            if job.stream:
                return await self._stream(request, response_id, outputs, choices)
            return await self._collect(response_id, outputs, choices)
        finally:
            self.metrics.finished("abort", len(choices.live))
            for rid in choices.live_requests():  # a client that went away, or a refused sibling: free it
                self.engine.abort(rid)
            self.admission.release(cost)

    async def _outputs(self, outputs: asyncio.Queue, choices: Choices):
        """Yield `(choice, text delta, finish reason, new token ids, logprobs)` until every
        choice ends; a stop string ends a choice at once (and aborts its sample)."""
        while choices.live:
            prompt_index, out = await outputs.get()
            c = choices.index(prompt_index, out.index)
            if c not in choices.live:  # the abort that followed a stop string
                continue
            if out.finish_reason == "error":
                choices.live.discard(c)
                self.metrics.finished("error")
                raise _failure(out, choices.job, self.engine.error)
            choices.note_prompt_logprobs(c, out.prompt_logprobs)
            stream = choices.streams[c]
            delta = stream.push(out.new_token_ids, final=out.finished)
            reason = out.finish_reason
            if stream.stopped:
                reason = "stop"
                self.engine.abort(*choices.request_of(c), reason="stop")
            if reason is not None:
                choices.live.discard(c)
                choices.reasons[c] = reason
                self.metrics.finished(reason)
            yield c, delta, reason, out.new_token_ids, choices.logprobs_body(c, out.logprobs)

    async def _collect(self, response_id, outputs, choices: Choices) -> web.Response:
        async for _ in self._outputs(outputs, choices):
            pass
        usage = responses.usage(sum(map(len, choices.job.prompts)), choices.completion_tokens)
        return json_response(responses.response(choices.job, response_id, choices.response_choices(), usage))

    async def _stream(self, request, response_id, outputs, choices: Choices) -> web.StreamResponse:
        job = choices.job
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)

        async def send(body: dict) -> None:
            await response.write(f"data: {protocol.dumps(body)}\n\n".encode())

        try:
            for c in range(len(choices.streams)):  # chat's role, or the echoed prompt
                if job.kind == "chat" or choices.prompt_text(c):
                    await send(responses.chunk(job, response_id, c, choices.prompt_text(c), None, [], first=True))
            try:
                async for c, delta, reason, new_ids, logprobs in self._outputs(outputs, choices):
                    if choices.calls_tools:  # an answer parsed for tool calls streams whole, when it ends
                        if reason is not None:
                            content, calls, reason = choices.message(c)
                            await send(responses.chunk(job, response_id, c, content, reason,
                                                       choices.streams[c].token_ids, tool_calls=calls))
                    elif delta or new_ids or reason:
                        await send(responses.chunk(job, response_id, c, delta, reason, new_ids, logprobs=logprobs))
            except APIError as e:  # the status line is gone: the error travels as an event
                await send(e.body())
            except ConnectionResetError:
                raise
            except Exception as e:
                log.error("internal error in a stream:\n%s", traceback.format_exc())
                await send(APIError(500, f"internal error: {e}").body())
            if job.include_usage:
                await send(responses.usage_chunk(job, response_id, responses.usage(
                    sum(map(len, job.prompts)), choices.completion_tokens)))
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
        except ConnectionResetError:  # the client went away: the caller's finally frees its requests
            log.info("client disconnected from stream %s", response_id)
        return response

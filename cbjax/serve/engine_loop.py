"""The engine loop: one thread owns the `LLM` and steps it; other threads talk to it by message.

The HTTP front runs on an asyncio loop in another thread. Nothing but this thread
touches the LLM (its scheduler, caches and request table are plain Python, not
thread-safe), so the front sends commands (submit, abort, stop) through a queue that
the loop drains between rounds, and gets results back through callbacks it supplies.
A bad request is refused by `add_request` here and its future carries the error; the
round goes on for everyone else.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import queue
import threading
import time
import traceback
from typing import Callable

from cbjax import Front, Load, Prompt, RequestOutput, SamplingParams
from cbjax.experimental import LARGE_CHUNK, SMALL_CHUNK

Sink = Callable[[RequestOutput], None]
SCORING_SHARE = 0.2  # of the engine's time, for prompt logprobs while requests are running


@dataclasses.dataclass
class _Submit:
    prompt: Prompt
    sampling: SamplingParams
    sink: Sink
    arrival_time: float
    request_id: str | None
    future: concurrent.futures.Future
    priority: float = 0
    scorer: object | None = None  # its prompt logprobs' `PromptScorer`, when it asks for them
    lora: str | None = None  # the LoRA adapter it runs (None: the base model)


class EngineLoop:
    """Steps `llm` on a thread of its own. `on_output(output)` sees every output the loop
    hands to a sink (the metrics hook), on the engine thread."""

    def __init__(self, llm: Front, on_output: Sink | None = None, idle_poll_s: float = 0.05):
        self.llm = llm
        self.on_output = on_output
        self.idle_poll_s = idle_poll_s
        self.load = Load()
        self.error: str | None = None  # set if a round raised: the engine is no longer trusted
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._sinks: dict[str, Sink] = {}
        self._scoring: collections.deque[_Submit] = collections.deque()  # waiting for their prompt logprobs
        self._scoring_credit = 0.0  # seconds scoring may still take before the next chunk (<0: in debt)
        self._thread = threading.Thread(target=self._run, name="cbjax-engine-loop", daemon=True)
        llm.watch_arrivals(lambda: not self._commands.empty())  # requests arrive at any time
        if llm.scheduler_config.policy == "static":
            # A server never knows that no more requests are coming: a static batch forms
            # from whatever waits when the previous one ends, instead of waiting to be full.
            llm.drain(True)

    # ------------------------------------------------------ other threads
    def start(self) -> "EngineLoop":
        self._thread.start()
        return self

    def stop(self, timeout: float | None = 10.0) -> None:
        if self._thread.is_alive():
            self._commands.put(("stop",))
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    def submit(self, prompt: Prompt, sampling: SamplingParams, sink: Sink,
               arrival_time: float | None = None, request_id: str | None = None,
               priority: float = 0, lora: str | None = None) -> concurrent.futures.Future:
        """Queue a request; the future gives its id, or the ValueError that refused it.
        `sink(output)` is then called on the engine thread with each output of the request,
        the last one finished."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        if not self.alive:
            future.set_exception(RuntimeError(self.error or "the engine loop is not running"))
            return future
        arrival = self.llm.clock() if arrival_time is None else arrival_time
        self._commands.put(("submit", _Submit(prompt, sampling, sink, arrival, request_id, future, priority,
                                              lora=lora)))
        return future

    def call(self, fn: Callable[[Front], object]) -> concurrent.futures.Future:
        """Run `fn(llm)` on the engine thread between rounds (loading a LoRA adapter); the future
        gives its result or the ValueError it raised."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        if not self.alive:
            future.set_exception(RuntimeError(self.error or "the engine loop is not running"))
            return future
        self._commands.put(("call", fn, future))
        return future

    def abort(self, request_id: str, index: int | None = None, reason: str = "abort") -> None:
        """Abort a request (or sample `index` of one with n > 1) if it is still live (a no-op once
        it has finished). `reason` is the finish reason its last output carries: "stop" when
        the front ends it on a stop string, so the metrics count what the client saw."""
        self._commands.put(("abort", request_id, index, reason))

    # -------------------------------------------------------- engine thread
    def _run(self) -> None:
        try:
            stepped_s = 0.0
            while self._handle_commands(block=not self.llm.has_unfinished_requests() and not self._scoring):
                if self._scoring:
                    self._score_chunk(stepped_s)
                if self.llm.has_unfinished_requests():
                    start = time.perf_counter()
                    self._dispatch(self.llm.step())
                    stepped_s = time.perf_counter() - start
                    self._note_load()
                    if self.llm.idle:  # e.g. a dynamic batch's window is open
                        self._handle_commands(block=True, timeout=self._idle_wait(self.llm.wake_time))
        except Exception:  # a bug in a round: fail everything in flight, refuse new work
            self.error = "the engine loop stopped on an internal error:\n" + traceback.format_exc()
            self._fail_all(self.error)
            return
        self._fail_all("the server is shutting down")

    def _idle_wait(self, wake_time: float | None) -> float:
        if wake_time is None:
            return self.idle_poll_s
        return min(max(wake_time - self.llm.clock(), 0.0), self.idle_poll_s)

    def _handle_commands(self, block: bool, timeout: float | None = None) -> bool:
        """Run every queued command (waiting for the first one if `block`); False on stop."""
        try:
            command = self._commands.get(timeout=timeout) if block else self._commands.get_nowait()
        except queue.Empty:
            return True
        while True:
            if command[0] == "stop":
                return False
            if command[0] == "submit":
                self._add(command[1])
            elif command[0] == "abort":
                self._abort(*command[1:])
            elif command[0] == "call" and command[2].set_running_or_notify_cancel():
                try:
                    command[2].set_result(command[1](self.llm))
                except ValueError as e:
                    command[2].set_exception(e)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _add(self, submit: _Submit) -> None:
        if not submit.future.set_running_or_notify_cancel():
            return
        if submit.sampling.prompt_logprobs is not None:
            try:
                submit.scorer = self.llm.prompt_scorer(submit.prompt, submit.sampling)
            except ValueError as e:
                submit.future.set_exception(e)
                return
            if submit.scorer is not None:
                self._scoring.append(submit)  # admitted once scored, a chunk per round (_score_chunk)
                return
        self._admit(submit)

    def _score_chunk(self, stepped_s: float) -> None:
        """Score a chunk of the oldest prompt waiting for its logprobs, between two rounds of the
        batched step. With nothing running, a large chunk. Beside running requests, a small one,
        and only while scoring has had less than `SCORING_SHARE` of the engine's time
        (`stepped_s`: the last round's): most of their tokens then come with no scoring between
        them, and a delayed one waits a small chunk's forward, never a whole prompt's."""
        submit, busy = self._scoring[0], self.llm.has_unfinished_requests()
        if not submit.scorer.done:  # (a one-token prompt has nothing to score)
            chunk = SMALL_CHUNK if busy else LARGE_CHUNK
            self._scoring_credit = min(self._scoring_credit + SCORING_SHARE * stepped_s, 0.0) if busy else 0.0
            if not submit.scorer.ready(chunk) or self._scoring_credit < 0:
                if not busy:  # its program is compiling on its own thread: wait for it, not for work
                    time.sleep(0.02)
                return
            start = time.perf_counter()
            submit.scorer.advance(chunk)
            if busy:
                self._scoring_credit -= time.perf_counter() - start
        if submit.scorer.done:
            self._scoring.popleft()
            self._admit(submit, submit.scorer.result())

    def _admit(self, submit: _Submit, scored_prompt: list | None = None) -> None:
        try:
            request_id = self.llm.add_request(submit.prompt, submit.sampling, arrival_time=submit.arrival_time,
                                              request_id=submit.request_id, priority=submit.priority,
                                              lora=submit.lora,
                                              **({"scored_prompt": scored_prompt} if scored_prompt else {}))
        except ValueError as e:
            submit.future.set_exception(e)
            return
        self._sinks[request_id] = submit.sink
        submit.future.set_result(request_id)
        self._note_load()

    def _abort(self, request_id: str, index: int | None = None, reason: str = "abort") -> None:
        for submit in [s for s in self._scoring if s.request_id == request_id]:  # not admitted yet
            self._scoring.remove(submit)
            submit.future.set_exception(RuntimeError(f"request {request_id!r} aborted"))
        if not self.llm.has_request(request_id):
            return
        try:
            aborted = self.llm.abort(request_id, index) if index is not None else self.llm.abort(request_id)
        except ValueError:  # that sample has finished already
            return
        aborted = aborted if isinstance(aborted, list) else [aborted]
        self._dispatch([dataclasses.replace(o, finish_reason=reason) for o in aborted])
        self._note_load()

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            self._deliver(output)
        for output in outputs:  # a request with n > 1 samples keeps its sink until the last one ends
            if output.finished and not self.llm.has_request(output.request_id):
                self._sinks.pop(output.request_id, None)

    def _deliver(self, output: RequestOutput) -> None:
        sink = self._sinks.get(output.request_id)
        if self.on_output is not None:
            self.on_output(output)
        if sink is not None:
            try:
                sink(output)
            except Exception:  # a closed front must not stop the loop
                traceback.print_exc()

    def _fail_all(self, message: str) -> None:
        for request_id, sink in list(self._sinks.items()):
            request = self.llm.requests.get(request_id)
            metrics = request.metrics if request is not None else None
            try:
                sink(RequestOutput(request_id, [], [], None, "error", metrics, error=message))
            except Exception:
                traceback.print_exc()
        self._sinks.clear()
        while self._scoring:
            self._scoring.popleft().future.set_exception(RuntimeError(message))
        while True:  # refuse what is still queued
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            if command[0] == "submit" and command[1].future.set_running_or_notify_cancel():
                command[1].future.set_exception(RuntimeError(message))
            elif command[0] == "call" and command[2].set_running_or_notify_cancel():
                command[2].set_exception(RuntimeError(message))

    def _note_load(self) -> None:
        self.load = self.llm.load()

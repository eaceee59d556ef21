"""The front door: `LLM(model, **engine_options)`.

Offline: `generate(prompts, sampling_params)`. Online: `add_request` / `step` /
`abort` / `has_unfinished_requests`, with each step's new tokens streamed back.
`replay(workload)` admits each request at its arrival time on the wall clock.
"""

from __future__ import annotations

import itertools
import time
import zlib
from typing import Callable, Sequence

import jax
import numpy as np

from cbjax import checks
from cbjax.runtime import sharding
from cbjax.loading import Model, load_model
from cbjax.scheduling.block_manager import BlockManager
from cbjax.runtime.engine import Engine, EngineConfig, PrefillRequest
from cbjax.runtime.mixed_step import MixedRow
from cbjax.models.kv_cache import kv_capacity
from cbjax.request import FinishReason, Request, RequestOutput, RequestState, SamplingParams
from cbjax.scheduling.scheduler import Plan, Scheduler, SchedulerConfig
from cbjax.core.step_stats import StepStats

Prompt = str | Sequence[int]


class LLM:
    def __init__(
        self,
        model: str | Model,
        *,
        policy: str = "continuous",
        num_slots: int = 8,
        max_seq_len: int = 512,
        batch_size: int | None = None,
        window_ms: float = 50.0,
        refill_interval: int = 1,
        waiting_served_ratio: float = 0.0,
        max_waiting_steps: int = 20,
        max_prefill_tokens: int | None = None,
        ordering: str = "fcfs",
        length_aware: bool = False,
        decode_steps: int = 1,
        prefill_floor: int = 16,
        dtype: str = "float32",
        seed: int = 0,
        kv_cache: str = "slots",
        kv_cache_bytes: int | None = None,
        page_size: int = 16,
        num_pages: int | None = None,
        enable_prefix_caching: bool = False,
        attention: str = "reference",
        merge_mode: str = "prefill_first",
        max_num_batched_tokens: int | None = None,
        clock: Callable[[], float] = time.perf_counter,
        simulate=None,
        tensor_parallel: int = 1,
        devices: Sequence | None = None,
        mesh=None,
        pipeline_stages: int = 1,
        micro_batches: int = 1,
    ):
        """`simulate`: run on the scheduling simulator instead of the device, an accelerator
        name (roofline) or a calibration file or cost model (cbjax.simulator); time is then
        simulated, and `model` may name a shape from cbjax.simulator.MODEL_SHAPES.

        `tensor_parallel`: shard the params and the KV cache over that many of `devices`
        (default: `jax.devices()`, every process's); or pass a ready `mesh` with a "tp" axis
        (cbjax/sharding.py). `devices` alone pins a single-device engine to `devices[0]`.
        `pipeline_stages`: split the layers over that many devices instead, decoding the
        slots in `micro_batches` groups (cbjax/pipeline.py)."""
        if merge_mode in ("fused", "chunked") and max_num_batched_tokens is None:
            # Sarathi-style budget for chunks; a whole longest prompt beside every decode for fused.
            max_num_batched_tokens = max(256, 2 * num_slots) if merge_mode == "chunked" else max_seq_len + num_slots
        # Both configs check their knobs before the model loads, so a bad one fails fast.
        scheduler_options = dict(
            merge_mode=merge_mode, max_num_batched_tokens=max_num_batched_tokens,
            policy=policy, batch_size=batch_size, window_ms=window_ms, refill_interval=refill_interval,
            waiting_served_ratio=waiting_served_ratio, max_waiting_steps=max_waiting_steps,
            max_prefill_tokens=max_prefill_tokens, ordering=ordering, length_aware=length_aware,
            decode_steps=decode_steps)
        engine_options = dict(max_seq_len=max_seq_len, prefill_floor=prefill_floor, decode_steps=decode_steps,
                              kv_cache=kv_cache, page_size=page_size, attention=attention, merge_mode=merge_mode,
                              max_num_batched_tokens=max_num_batched_tokens)
        SchedulerConfig(num_slots=num_slots, **scheduler_options)
        EngineConfig(num_slots=num_slots, num_pages=num_pages, **engine_options)
        if kv_cache_bytes is not None:
            kv_cache_bytes = checks.integer("kv_cache_bytes", kv_cache_bytes, 1, 2 ** 62)
        tensor_parallel = checks.integer("tensor_parallel", tensor_parallel, 1)
        pipeline_stages = checks.integer("pipeline_stages", pipeline_stages, 1)
        if pipeline_stages > 1 and (tensor_parallel > 1 or mesh is not None):
            raise ValueError("pipeline stages and tensor parallelism do not combine yet: choose one")
        if mesh is None and pipeline_stages == 1 and (tensor_parallel > 1 or devices is not None):
            mesh = sharding.tensor_parallel_mesh(tensor_parallel, devices)
        if (mesh is not None or pipeline_stages > 1) and simulate is not None:
            raise ValueError("simulate runs no device: it takes no tensor_parallel, devices or mesh")
        if simulate is not None:
            from cbjax import simulator

            if not isinstance(model, Model):
                model = simulator.model_for_simulation(model, dtype=dtype)
            if isinstance(simulate, str):
                simulate = simulator.load_cost_model(simulate, model.config, 2 if dtype == "bfloat16" else 4)
            if clock is time.perf_counter:
                clock = simulator.SimClock()
        self.model = model if isinstance(model, Model) else load_model(model, dtype=dtype)
        self.tokenizer = self.model.tokenizer
        if kv_cache_bytes is not None:  # one memory budget from which either layout sizes itself
            num_slots, num_pages = kv_capacity(self.model.config, kv_cache, kv_cache_bytes, max_seq_len,
                                               page_size, dtype, num_slots)
        self.scheduler_config = SchedulerConfig(num_slots=num_slots, **scheduler_options)
        engine_config = EngineConfig(num_slots=num_slots, num_pages=num_pages, **engine_options)
        if simulate is not None:
            self.engine = simulator.SimulatedEngine(self.model, engine_config, simulate, clock)
        elif pipeline_stages > 1:
            from cbjax.runtime.pipeline import PipelineEngine

            self.engine = PipelineEngine(self.model, engine_config, pipeline_stages, micro_batches, devices)
        else:
            self.engine = Engine(self.model, engine_config, mesh=mesh)
        self.pages = None
        if kv_cache == "paged":
            self.pages = BlockManager(self.engine.config.num_pages, page_size, enable_prefix_caching)
        self.scheduler = Scheduler(self.scheduler_config, set(self.model.config.eos_token_ids), max_seq_len,
                                   pages=self.pages)
        self.seed = checks.integer("seed", seed, 0, 2 ** 63 - 1)
        self.clock = clock
        # Live requests: waiting, running, or finished but not yet returned. A finished request
        # is released once an output with its finish has been handed back (step, generate,
        # replay, abort), so a long-running instance holds only what is in flight.
        self.requests: dict[str, Request] = {}
        self._finished_unreturned: list[Request] = []  # finished inside another call's loop
        self._ids = itertools.count()
        self._emitted: dict[str, int] = {}
        self.last_plan: Plan | None = None
        self.stats = StepStats()

    # ------------------------------------------------------------ requests
    def _prompt_ids(self, prompt: Prompt) -> tuple[list[int], str | None]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass prompts as lists of token ids")
            return list(self.tokenizer(prompt)["input_ids"]), prompt
        if isinstance(prompt, (bytes, bytearray, memoryview)) or not hasattr(prompt, "__iter__"):
            raise ValueError(f"a prompt must be a string or a sequence of integer token ids, "
                             f"got {type(prompt).__name__}")
        if type(prompt) is list and all(type(t) is int for t in prompt):  # the common case, without a call per id
            return list(prompt), None
        return [checks.integer("a prompt token id", t) for t in prompt], None

    def _validate(self, ids: list[int], sampling: SamplingParams) -> None:
        vocab = self.model.config.vocab_size
        max_len = self.engine.max_len
        if not ids:
            raise ValueError("empty prompt")
        bad = [t for t in ids if not 0 <= t < vocab] if min(ids) < 0 or max(ids) >= vocab else []
        if bad:
            raise ValueError(f"token ids outside the vocabulary [0, {vocab}): {bad[:8]}")
        if len(ids) >= max_len:
            raise ValueError(f"prompt of {len(ids)} tokens leaves no room to generate within "
                             f"max_seq_len={max_len}")
        bad = [t for t in sampling.stop_token_ids if t >= vocab]
        if bad:
            raise ValueError(f"stop_token_ids outside the vocabulary [0, {vocab}): {bad[:8]}")
        self.engine.stop_ids_for(sampling)
        if self.pages is not None:
            # Positions it can write: its last token is returned, never written back (the
            # scheduler's decode reservations use the same cap).
            written = min(len(ids) + sampling.max_tokens - 1, max_len)
            if self.pages.pages_needed(written) > self.pages.num_pages:
                raise ValueError(f"a request of up to {written + 1} tokens writes {written} to the cache, "
                                 f"{self.pages.pages_needed(written)} pages; the paged cache has "
                                 f"{self.pages.num_pages}: it could never fit")

    def _new_request_id(self) -> str:
        # Skip ids a user chose: auto ids share the namespace of live requests.
        while (request_id := str(next(self._ids))) in self.requests:
            pass
        return request_id

    def add_request(self, prompt: Prompt, sampling_params: SamplingParams | None = None, *,
                    request_id: str | None = None, priority: float = 0, arrival_time: float | None = None) -> str:
        """Queue a request; raises ValueError for a bad one (nothing else is touched)."""
        sampling = SamplingParams() if sampling_params is None else sampling_params
        if not isinstance(sampling, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(sampling).__name__}")
        if request_id is not None and not isinstance(request_id, (str, int)) or isinstance(request_id, bool):
            raise ValueError(f"request_id must be a string, got {type(request_id).__name__}")
        priority = checks.real("priority", priority)
        arrival = self.clock() if arrival_time is None else checks.real("arrival_time", arrival_time)
        ids, text = self._prompt_ids(prompt)
        self._validate(ids, sampling)
        request_id = self._new_request_id() if request_id is None else str(request_id)
        if request_id in self.requests:
            raise ValueError(f"duplicate request id {request_id!r}")
        request = Request(request_id, ids, sampling, arrival, priority=priority, prompt=text)
        self.requests[request_id] = request
        self._emitted[request_id] = 0
        self.scheduler.add(request)
        return request_id

    def abort(self, request_id: str) -> RequestOutput:
        request = self.requests.get(str(request_id))
        if request is None or request.finished:
            raise ValueError(f"cannot abort unknown or finished request {request_id!r}")
        slot = request.slot
        self.scheduler.abort(request.request_id, self.clock())
        if slot is not None:
            self.engine.deactivate(slot)
        return self._release(request, self._output(request))

    def _release(self, request: Request, output: RequestOutput) -> RequestOutput:
        del self.requests[request.request_id]
        del self._emitted[request.request_id]
        return output

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def warmup(self, max_prompt_len: int | None = None) -> int:
        """Compile every program this configuration can reach (so timings exclude
        compilation): prefill continuations at any attended length when prompts can be
        chunked or resume from cached prefix pages. `max_prompt_len` drops prefill buckets
        no prompt reaches. Returns the number of programs."""
        chunked = self.scheduler_config.max_prefill_tokens is not None or (
            self.pages is not None and self.pages.enable_prefix_caching)
        if max_prompt_len is not None:
            max_prompt_len = checks.integer("max_prompt_len", max_prompt_len, 1)
        return self.engine.warmup(chunked=chunked, max_prompt_len=max_prompt_len)

    # ---------------------------------------------------------------- step
    def _block_tables(self) -> np.ndarray:
        tables = np.zeros((self.engine.num_slots, self.engine.max_len // self.pages.page_size), np.int32)
        for slot, r in enumerate(self.scheduler.slots):
            if r is not None:
                pages = self.pages.tables[r.request_id]
                tables[slot, :len(pages)] = pages
        return tables

    def _request_seed(self, request: Request) -> int:
        if request.sampling.seed is not None:
            return request.sampling.seed
        return zlib.crc32(f"{self.seed}:{request.request_id}".encode()) & 0x7FFFFFFF

    def step(self) -> list[RequestOutput]:
        """One scheduling round: planned prefill chunks, then a decode call. Returns an
        output for every request that got new tokens or finished in this round."""
        touched, self._finished_unreturned = self._finished_unreturned + self._round(), []
        outputs = [self._output(r, stream=True) for r in touched]
        return [self._release(r, o) if r.finished else o for r, o in zip(touched, outputs)]

    def _round(self) -> list[Request]:
        """A round without building outputs; returns the requests it touched."""
        sched, engine, stats = self.scheduler, self.engine, self.stats
        t0 = time.perf_counter()
        plan = sched.schedule(self.clock())
        self.last_plan = plan
        t1 = time.perf_counter()
        stats.schedule_s += t1 - t0
        if plan.idle:
            return []
        for slot in plan.preempted_slots:
            engine.deactivate(slot)
        if self.pages is not None and engine.reads_block_tables:
            engine.set_block_tables(self._block_tables())
        if plan.mixed:
            return self._mixed_round(plan, t1)
        calls = engine.prefill([PrefillRequest(c.slot, c.tokens, c.start, c.is_last, c.request.sampling,
                                               self._request_seed(c.request), len(c.request.output_token_ids))
                                for c in plan.prefills])
        decoded = None
        if plan.decode:
            finishing = {c.request.request_id for c in plan.prefills if c.is_last}
            running = RequestState.RUNNING
            longest = max(len(r.prompt_token_ids) + len(r.output_token_ids) + (r.state != running)
                          for r in sched.slots if r is not None and (r.state == running or r.request_id in finishing))
            decoded = engine.decode(longest)
        # The one host copy of the round: every prefill's (token, done) and the decode tokens.
        t2 = time.perf_counter()
        host_prefill, host_decode = jax.device_get(([out for out, _ in calls], decoded))
        now = self.clock()
        t3 = time.perf_counter()
        stats.dispatch_s += t2 - t1
        stats.device_wait_s += t3 - t2
        firsts: dict[int, tuple[int, int]] = {}
        for out, rows in zip(host_prefill, (rows for _, rows in calls)):
            for r, i in enumerate(rows):
                firsts[i] = (int(out[r, 0]), int(out[r, 1]))
        touched = self._record_prefills(plan.prefills, [firsts[i] for i in range(len(plan.prefills))], now)
        if host_decode is not None:
            decoding = [r if r is not None and r.state == RequestState.RUNNING else None for r in sched.slots]
            mask = np.fromiter((r is not None for r in decoding), bool, len(decoding))
            idle = np.flatnonzero(mask & (host_decode[0] < 0))  # every running slot samples in step 0
            if idle.size:
                raise RuntimeError(f"engine and scheduler out of sync: slot {idle[0]} produced no token "
                                   f"for running request {decoding[idle[0]].request_id!r}")
            sched.on_decode(host_decode.tolist(), now)
            touched.update((r.request_id, r) for r in decoding if r is not None)
            stats.decode_steps += len(host_decode)
            stats.active_slot_steps += int((host_decode >= 0).sum())
        stats.rounds += 1
        stats.prefill_chunks += len(plan.prefills)
        stats.process_s += time.perf_counter() - t3
        return list(touched.values())

    def _mixed_round(self, plan: Plan, t_dispatch: float) -> list[Request]:
        """The round as one mixed step: the plan's chunks, then a decode row per running request."""
        sched, stats = self.scheduler, self.stats
        decoding = [r for r in sched.running if r.state == RequestState.RUNNING]
        rows = [MixedRow(c.slot, c.tokens, c.start, c.is_last, c.request.sampling, self._request_seed(c.request),
                         len(c.request.output_token_ids)) for c in plan.prefills]
        rows += [MixedRow(r.slot, [], r.num_tokens - 1) for r in decoding]
        out = self.engine.mixed_step(rows)
        t2 = time.perf_counter()
        host = jax.device_get(out)  # the one host copy of the round
        now = self.clock()
        t3 = time.perf_counter()
        stats.dispatch_s += t2 - t_dispatch
        stats.device_wait_s += t3 - t2
        touched = self._record_prefills(plan.prefills, host[:len(plan.prefills)].tolist(), now)
        if decoding:
            per_slot = [-1] * self.engine.num_slots
            for r, (token, _) in zip(decoding, host[len(plan.prefills):].tolist()):
                per_slot[r.slot] = token
            sched.on_decode([per_slot], now)
            touched.update((r.request_id, r) for r in decoding)
            stats.decode_steps += 1
            stats.active_slot_steps += len(decoding)
        stats.rounds += 1
        stats.prefill_chunks += len(plan.prefills)
        stats.process_s += time.perf_counter() - t3
        return list(touched.values())

    def _record_prefills(self, chunks, results, now: float) -> dict[str, Request]:
        """Hand each chunk's device result `(first token, done)` to the scheduler; returns the
        requests whose prompt ended (they got their first token), by id."""
        touched: dict[str, Request] = {}
        for chunk, (token, device_done) in zip(chunks, results):
            finished = self.scheduler.on_prefill(chunk, token if chunk.is_last else -1, now)
            if chunk.is_last:
                self._check_sync(chunk.request, bool(device_done), finished)
                touched[chunk.request.request_id] = chunk.request
        return touched

    def _check_sync(self, request: Request, device_done: bool, host_done: bool) -> None:
        if device_done != host_done:
            raise RuntimeError(f"engine and scheduler disagree on whether {request.request_id!r} finished")

    def _output(self, r: Request, stream: bool = False) -> RequestOutput:
        tokens = list(r.output_token_ids)
        new = tokens[self._emitted.get(r.request_id, 0):] if stream else []
        if stream:
            self._emitted[r.request_id] = len(tokens)
        text = None
        if self.tokenizer is not None and tokens and r.finished:  # streamed steps carry new_token_ids only
            text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        reason = None if r.finish_reason is None else r.finish_reason.value
        return RequestOutput(r.request_id, list(r.prompt_token_ids), tokens, text, reason, r.metrics,
                             prompt=r.prompt, error=r.error, new_token_ids=new)

    # ------------------------------------------------------------- offline
    def _error_output(self, request_id: str, prompt, message: str) -> RequestOutput:
        from cbjax.request import RequestMetrics

        now = self.clock()
        ids = list(prompt) if not isinstance(prompt, (str, bytes, bytearray)) and _is_int_list(prompt) else []
        metrics = RequestMetrics(arrival_time=now, finish_time=now)
        return RequestOutput(request_id, ids, [], None, FinishReason.ERROR.value, metrics,
                             prompt=prompt if isinstance(prompt, str) else None, error=message)

    def generate(self, prompts: Sequence[Prompt] | Prompt,
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, desc: str | None = None) -> list[RequestOutput]:
        """Run prompts to completion; outputs in input order. A bad prompt gets an
        `error` output with its message; the others run unharmed."""
        if isinstance(prompts, str) or (len(prompts) > 0 and _is_int_list(prompts)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_list = [sampling_params] * len(prompts)
        else:
            sampling_list = list(sampling_params)
            if len(sampling_list) != len(prompts):
                raise ValueError(f"{len(prompts)} prompts but {len(sampling_list)} sampling params")
        ids: list[str] = []
        errors: dict[int, RequestOutput] = {}
        for i, (prompt, sp) in enumerate(zip(prompts, sampling_list)):
            try:
                ids.append(self.add_request(prompt, sp))
            except ValueError as e:
                ids.append("")
                errors[i] = self._error_output(f"error-{i}", prompt, str(e))
        self._keep_others(self._run_until_done(len(prompts) - len(errors), use_tqdm, desc), ids)
        return [errors[i] if i in errors else self._release(self.requests[rid], self._output(self.requests[rid]))
                for i, rid in enumerate(ids)]

    def _keep_others(self, finished: list[Request], mine: list[str | None]) -> None:
        """Requests added online that finished while generate/replay drove the loop: the
        next `step()` returns them."""
        mine_set = set(mine)
        self._finished_unreturned += [r for r in finished if r.request_id not in mine_set]

    def run_until_done(self, use_tqdm: bool = False) -> list[RequestOutput]:
        """Step until every request has finished; returns (and releases) the outputs of the
        requests that finished meanwhile, in the order they finished."""
        finished = self._finished_unreturned + self._run_until_done(None, use_tqdm, None)
        self._finished_unreturned = []
        return [self._release(r, self._output(r)) for r in finished]

    def _run_until_done(self, total: int | None, use_tqdm: bool, desc: str | None) -> list[Request]:
        finished: list[Request] = []
        self.scheduler.drain(True)
        bar = self._progress(total, use_tqdm, desc)
        try:
            while self.has_unfinished_requests():
                done = [r for r in self._round() if r.finished]
                finished += done
                bar.update(len(done))
                if self.last_plan is not None and self.last_plan.idle:
                    self._sleep_until(self.last_plan.wake_time)
        finally:
            bar.close()
            self.scheduler.drain(False)
        return finished

    def _progress(self, total: int | None, use_tqdm: bool, desc: str | None):
        from tqdm.auto import tqdm

        if desc is None:
            desc = self.scheduler_config.policy + ("-paged" if self.pages is not None else "")
        return tqdm(total=total, desc=desc, disable=not use_tqdm, unit="req")

    def _sleep_until(self, wake_time: float | None, cap: float = 0.05) -> None:
        now = self.clock()
        if hasattr(self.clock, "advance"):  # simulated time jumps straight to the wake-up
            self.clock.advance(cap if wake_time is None else wake_time - now)
            return
        delay = cap if wake_time is None else min(max(wake_time - now, 0.0), cap)
        if delay > 0:
            time.sleep(delay)

    # -------------------------------------------------------------- replay
    def replay(self, workload: Sequence[tuple[float, Prompt, SamplingParams]], use_tqdm: bool = True,
               desc: str | None = None) -> list[RequestOutput]:
        """Admit each `(arrival_offset_s, prompt, sampling)` at its time on the wall clock,
        stepping the engine meanwhile; outputs in workload order."""
        order = sorted(range(len(workload)), key=lambda i: workload[i][0])
        ids: list[str | None] = [None] * len(workload)
        start = self.clock()
        bar = self._progress(len(workload), use_tqdm, desc or f"replay {self.scheduler_config.policy}")
        pending = 0
        finished: list[Request] = []
        try:
            while pending < len(order) or self.has_unfinished_requests():
                now = self.clock()
                while pending < len(order) and start + workload[order[pending]][0] <= now:
                    i = order[pending]
                    offset, prompt, sp = workload[i]
                    ids[i] = self.add_request(prompt, sp, arrival_time=start + offset)
                    pending += 1
                self.scheduler.drain(pending == len(order))
                done = [r for r in self._round() if r.finished]
                finished += done
                bar.update(len(done))
                if self.last_plan is not None and self.last_plan.idle:
                    next_arrival = start + workload[order[pending]][0] if pending < len(order) else None
                    wakes = [t for t in (next_arrival, self.last_plan.wake_time) if t is not None]
                    self._sleep_until(min(wakes) if wakes else None)
        finally:
            bar.close()
            self.scheduler.drain(False)
        self._keep_others(finished, ids)
        return [self._release(self.requests[rid], self._output(self.requests[rid])) for rid in ids]


def _is_int_list(x) -> bool:
    try:
        return len(x) > 0 and all(isinstance(t, int) or hasattr(t, "__index__") for t in x) \
            and not isinstance(x, str)
    except TypeError:
        return False

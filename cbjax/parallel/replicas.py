"""Data-parallel serving: several `LLM` engines on disjoint device groups behind one front.

Each replica is a whole engine (scheduler, KV cache, params) on its own group of
`tensor_parallel` devices; the front routes each request to one replica and steps
them all; routing.py says which replica a request goes to.

Replicas step concurrently from a thread each: JAX releases the GIL while a device
runs and while the host waits for its result, so one replica's device work overlaps
another's scheduling. Simulated (`simulate=...`), each replica runs on its own
`LaneClock` and a step runs the earliest busy one, so replicas overlap in simulated
time on one shared clock (as the disaggregated front's instances do).
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Sequence

import jax

from cbjax import checks
from cbjax.core.step_stats import Load
from cbjax.core.replay import run_arrivals
from cbjax.llm import LLM, Prompt, offline_workload, progress_bar
from cbjax.loading import Model, load_model
from cbjax.parallel.routing import Router
from cbjax.request import RequestOutput, SamplingParams

class Replicas:
    def __init__(self, model: str | Model, *, data_parallel: int = 2, tensor_parallel: int = 1,
                 routing: str = "round_robin", devices: Sequence | None = None, affinity_tokens: int = 16,
                 affinity_slack: int | None = None, parallel_step: bool = True, dtype: str = "float32",
                 simulate=None, **llm_options):
        """`llm_options` configure every replica (see `LLM`); `devices` (default `jax.devices()`)
        is cut into `data_parallel` groups of `tensor_parallel`."""
        self.data_parallel = checks.integer("data_parallel", data_parallel, 1)
        tensor_parallel = checks.integer("tensor_parallel", tensor_parallel, 1)
        self.router = Router(routing, affinity_tokens, affinity_slack)
        self.simulated = simulate is not None
        self.clock: Callable[[], float]
        if self.simulated:
            from cbjax import simulator

            model = model if isinstance(model, Model) else simulator.model_for_simulation(model, dtype=dtype)
            self.clock = simulator.SimClock()
            self.replicas = [LLM(model, tensor_parallel=tensor_parallel, dtype=dtype, simulate=simulate,
                                 clock=simulator.LaneClock(), **llm_options) for _ in range(self.data_parallel)]
        else:
            devices = list(jax.devices() if devices is None else devices)
            need = self.data_parallel * tensor_parallel
            if need > len(devices):
                raise ValueError(f"data_parallel={data_parallel} x tensor_parallel={tensor_parallel} needs {need} "
                                 f"devices, {len(devices)} are available")
            model = model if isinstance(model, Model) else load_model(model, dtype=dtype)
            self.replicas = [LLM(model, tensor_parallel=tensor_parallel, dtype=dtype,
                                 devices=devices[i * tensor_parallel:(i + 1) * tensor_parallel], **llm_options)
                             for i in range(self.data_parallel)]
            self.clock = self.replicas[0].clock
        self.router.attach([r.load for r in self.replicas], self.replicas[0].scheduler_config.num_slots)
        self.model, self.tokenizer = model, model.tokenizer
        self.grammars = self.replicas[0].grammars  # one structured-output compiler: the tokenizer is read once
        for r in self.replicas[1:]:
            r.grammars = self.grammars
        many = parallel_step and self.data_parallel > 1 and not self.simulated
        self._pool = ThreadPoolExecutor(self.data_parallel) if many else None
        self._owner: dict[str, int] = {}  # live request id -> replica index
        self._ids = itertools.count()

    routing = property(lambda self: self.router.routing)
    routed = property(lambda self: self.router.routed)

    # ----------------------------------------------------------- requests
    def add_request(self, prompt: Prompt, sampling_params: SamplingParams | None = None, *,
                    request_id: str | None = None, priority: float = 0, arrival_time: float | None = None,
                    scored_prompt: list | None = None, lora: str | None = None) -> str:
        """Route and queue a request; raises ValueError for a bad one (nothing else is touched).
        `scored_prompt`, `lora`: as `LLM.add_request` (the replicas' engines score alike; every
        replica loads every adapter)."""
        # Only prefix affinity needs the token ids before the replica tokenizes the prompt itself.
        ids = self.replicas[0].prompt_ids(prompt)[0] if self.router.reads_prompt else None
        if request_id is None:
            while (request_id := str(next(self._ids))) in self._owner:
                pass
        elif str(request_id) in self._owner:
            raise ValueError(f"duplicate request id {request_id!r}")
        i = self.router.route(ids)
        if self.simulated and not self.replicas[i].has_unfinished_requests():  # an idle lane starts now
            self.replicas[i].clock.catch_up(self.clock() if arrival_time is None else arrival_time)
        rid = self.replicas[i].add_request(prompt, sampling_params, request_id=request_id, priority=priority,
                                           arrival_time=arrival_time, scored_prompt=scored_prompt, lora=lora)
        self._owner[rid] = i
        self.router.routed_to(i)
        return rid

    def load_lora(self, name: str, path: str) -> None:
        """Load the adapter into every replica (none keeps it if one refuses it)."""
        done = []
        try:
            for replica in self.replicas:
                replica.load_lora(name, path)
                done.append(replica)
        except ValueError:
            for replica in done:
                replica.unload_lora(name)
            raise

    def unload_lora(self, name: str) -> None:
        """Unload the adapter from every replica (refused while any replica's request uses it)."""
        in_use = [r for r in self.replicas if any(q.lora == name for q in r.requests.values())]
        if in_use:
            in_use[0].unload_lora(name)  # raises, naming the requests
        for replica in self.replicas:
            replica.unload_lora(name)

    def lora_adapters(self) -> list[str]:
        return self.replicas[0].lora_adapters()

    def abort(self, request_id: str, index: int | None = None):
        """As `LLM.abort` (a request with n > 1 samples: sample `index`, else every live sample's output)."""
        i = self._owner.get(str(request_id))
        if i is None:
            raise ValueError(f"cannot abort unknown or finished request {request_id!r}")
        out = self.replicas[i].abort(request_id, index)
        if not self.replicas[i].has_request(str(request_id)):
            del self._owner[str(request_id)]
        return out

    def has_unfinished_requests(self) -> bool:
        return any(r.has_unfinished_requests() for r in self.replicas)

    # ------------------------------------------- what a front reads (the server's engine loop)
    def has_request(self, request_id: str) -> bool:
        i = self._owner.get(str(request_id))
        return i is not None and self.replicas[i].has_request(str(request_id))

    @property
    def requests(self) -> collections.ChainMap:
        """Every replica's live requests, by id."""
        return collections.ChainMap(*(r.requests for r in self.replicas))

    # Every replica is configured alike.
    scheduler_config = property(lambda self: self.replicas[0].scheduler_config)
    max_model_len = property(lambda self: self.replicas[0].max_model_len)
    engine_info = property(lambda self: self.replicas[0].engine_info)

    def prompt_scorer(self, prompt: Prompt, sampling: SamplingParams) -> None:
        return None  # the replica is chosen by `add_request`, which scores the prompt there at once

    def watch_arrivals(self, pending) -> None:
        for r in self.replicas:
            r.watch_arrivals(pending)

    def use_length_predictor(self, predict) -> None:
        for r in self.replicas:
            r.use_length_predictor(predict)

    def warm_structured_output(self, background: bool = False) -> int:
        return sum(r.warm_structured_output(background) for r in self.replicas)

    def wait_for_compiles(self) -> int:
        return sum(r.wait_for_compiles() for r in self.replicas)

    def load(self) -> Load:
        """What all replicas hold together (their KV usage: the mean)."""
        return Load.combine([r.load() for r in self.replicas])

    def warmup(self) -> int:
        return sum(r.warmup() for r in self.replicas)

    def step(self) -> list[RequestOutput]:
        """One round of every replica (simulated: of the earliest busy one); their outputs,
        replica by replica."""
        if self.simulated:
            per_replica = self._simulated_step()
        elif self._pool is None:
            per_replica = [r.step() for r in self.replicas]
        else:
            per_replica = list(self._pool.map(LLM.step, self.replicas))
        outputs = [o for outs in per_replica for o in outs]
        for o in outputs:  # a request with n > 1 samples is live until its last sample ends
            i = self._owner.get(o.request_id)
            if o.finish_reason is not None and i is not None and not self.replicas[i].has_request(o.request_id):
                del self._owner[o.request_id]
        return outputs

    def finish_round(self) -> list[RequestOutput]:
        return [o for o in self.step() if o.finish_reason is not None]

    def _simulated_step(self) -> list[list[RequestOutput]]:
        busy = [r for r in self.replicas if r.has_unfinished_requests()]
        outputs = [min(busy, key=lambda r: r.clock()).step()] if busy else []
        self.clock.follow([r.clock() for r in self.replicas if r.has_unfinished_requests()],
                          [r.clock() for r in self.replicas])
        return outputs

    @property
    def idle(self) -> bool:
        if self.simulated:
            return not self.has_unfinished_requests()
        return all(r.idle for r in self.replicas)

    @property
    def wake_time(self) -> float | None:
        wakes = [r.wake_time for r in self.replicas if r.wake_time is not None]
        return min(wakes) if wakes else None

    def drain(self, draining: bool = True) -> None:
        for r in self.replicas:
            r.drain(draining)

    # ------------------------------------------------------------ offline
    def generate(self, prompts: Sequence[Prompt] | Prompt,
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Run prompts to completion over the replicas; outputs in input order (a bad prompt
        gets an `error` output, as `LLM.generate`)."""
        return self._run(offline_workload(prompts, sampling_params), realtime=False, use_tqdm=use_tqdm)

    def replay(self, workload: Sequence[tuple[float, Prompt, SamplingParams]], use_tqdm: bool = True,
               desc: str | None = None, concurrency: int | None = None) -> list[RequestOutput]:
        """`LLM.replay` over the replicas: each request admitted at its arrival time, or by
        a closed-loop client of `concurrency` (a bad one gets an `error` output)."""
        return self._run(list(workload), realtime=True, use_tqdm=use_tqdm, desc=desc, concurrency=concurrency)

    def _run(self, workload, realtime: bool, use_tqdm: bool, desc: str | None = None,
             concurrency: int | None = None) -> list[RequestOutput]:
        bar = progress_bar(len(workload), use_tqdm, desc or f"{self.data_parallel} replicas, {self.routing}")
        ids, errors, finished = run_arrivals(self, workload, bar, realtime=realtime, catch_errors=True,
                                             concurrency=concurrency)
        done: dict[str, list[RequestOutput]] = {}
        for o in finished:
            done.setdefault(o.request_id, []).append(o)
        return [self.replicas[0].error_output(f"error-{i}", workload[i][1], errors[i]) if i in errors
                else _one_output(done[rid]) for i, rid in enumerate(ids)]

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()


def _one_output(outputs: list[RequestOutput]) -> RequestOutput:
    """A request's output: its only one, or with n > 1 samples sample 0's with all in `samples`."""
    if len(outputs) == 1:
        return outputs[0]
    outputs = sorted(outputs, key=lambda o: o.index)
    return dataclasses.replace(outputs[0], samples=outputs)

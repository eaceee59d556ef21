"""The front door: `LLM(model, **engine_args)`. Requests in, outputs out.

Offline: `generate(prompts, sampling_params)`. Online: `add_request` / `step` /
`abort` / `has_unfinished_requests`, with each step's new tokens streamed back.
`replay(workload)` admits each request at its arrival time on the wall clock. The
rounds themselves run in the engine core (cbjax/core/engine_core.py).
"""

from __future__ import annotations

import dataclasses
import itertools
import time
import zlib
from typing import Callable, Sequence

from cbjax import checks, compile_cache
from cbjax.core import EngineArgs, StepStats, build_core
from cbjax.core.disaggregation import build_disaggregated
from cbjax.core.replay import run_arrivals, sleep_until
from cbjax.core.sample_groups import SampleGroups
from cbjax.grammar import Grammars
from cbjax.loading import Model
from cbjax.request import FinishReason, Request, RequestMetrics, RequestOutput, SamplingParams

Prompt = str | Sequence[int]


def progress_bar(total: int | None, use_tqdm: bool, desc: str):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, disable=not use_tqdm, unit="req")


def drive(core, clock, bar) -> list[Request]:
    """Run rounds on `core` until nothing is unfinished (no more arrivals: a static batch may
    run partial); returns what finished, in finishing order."""
    finished = []
    core.drain(True)
    try:
        while core.has_unfinished():
            done = [r for r in core.run_round() if r.finished]
            finished += done
            bar.update(len(done))
            if core.idle and core.has_unfinished():
                sleep_until(clock, core.wake_time)
    finally:
        bar.close()
        core.drain(False)
    return finished


class LLM:
    def __init__(self, model: str | Model, args: EngineArgs | None = None, *,
                 clock: Callable[[], float] = time.perf_counter, simulate=None, devices: Sequence | None = None,
                 mesh=None, **engine_args):
        """`engine_args`: the fields of `EngineArgs` (cbjax/core/engine_args.py documents each),
        or a ready `args` (keywords then override its fields).

        `simulate`: run on the scheduling simulator instead of the device, an accelerator
        name (roofline) or a calibration file or cost model (cbjax.simulator); time is then
        simulated, and `model` may name a shape from cbjax.simulator.MODEL_SHAPES.
        `tensor_parallel`: shard the params and the KV cache over that many of `devices`
        (default: `jax.devices()`, every process's); or pass a ready `mesh` with a "tp" axis
        (runtime/sharding.py). `devices` alone pins a single-device engine to `devices[0]`.
        `pipeline_stages`: split the layers over that many devices instead, decoding the
        slots in `micro_batches` groups (runtime/pipeline.py). `prefill_instances`: prefill and decode apart."""
        args = EngineArgs(**engine_args) if args is None else dataclasses.replace(args, **engine_args)
        self.args = args
        compile_cache.enable()  # a directory already chosen (the server's flag, a test's) is kept
        build = build_disaggregated if args.prefill_instances else build_core
        self.model, self.core = build(model, args, clock=clock, simulate=simulate, devices=devices, mesh=mesh)
        self.tokenizer = self.model.tokenizer
        self.seed = args.seed
        self.clock = self.core.clock
        # Live requests: waiting, running, or finished but not yet returned. A finished request
        # is released once an output with its finish has been handed back (step, generate,
        # replay, abort), so a long-running instance holds only what is in flight.
        self.requests: dict[str, Request] = {}
        self._finished_unreturned: list[Request] = []  # finished inside another call's loop
        self._ids = itertools.count()
        self._emitted: dict[str, int] = {}
        self.groups = SampleGroups()  # requests with n > 1 samples
        # Structured output's compiler (llguidance over the tokenizer, read on first use).
        self.grammars = Grammars(self.tokenizer, self.model.config.vocab_size, tuple(self.model.config.eos_token_ids))

    def load(self):  # what the engine holds after its latest round (`cbjax.core.engine_core.Load`)
        return self.core.load()

    # What the core holds, for tests, experiments and other fronts to read.
    engine = property(lambda self: self.core.engine)
    scheduler = property(lambda self: self.core.scheduler)
    scheduler_config = property(lambda self: self.core.scheduler.config)
    pages = property(lambda self: self.core.pages)
    stats = property(lambda self: self.core.stats)
    idle = property(lambda self: self.core.idle)
    wake_time = property(lambda self: self.core.wake_time)

    # ------------------------------------------------------------ requests
    def prompt_ids(self, prompt: Prompt) -> tuple[list[int], str | None]:
        return prompt_token_ids(self.tokenizer, prompt)

    def _new_request_id(self) -> str:
        # Skip ids a user chose: auto ids share the namespace of live requests.
        while (request_id := str(next(self._ids))) in self.requests:
            pass
        return request_id

    def _request_seed(self, request_id: str, sampling: SamplingParams) -> int:
        return sampling.seed if sampling.seed is not None else \
            zlib.crc32(f"{self.seed}:{request_id}".encode()) & 0x7FFFFFFF

    def add_request(self, prompt: Prompt, sampling_params: SamplingParams | None = None, *,
                    request_id: str | None = None, priority: float = 0, arrival_time: float | None = None,
                    scored_prompt: list | None = None) -> str:
        """Queue a request; raises ValueError for a bad one (nothing else is touched).
        `scored_prompt`: its prompt logprobs, when the caller computed them (`engine.prompt_scorer`)."""
        sampling = SamplingParams() if sampling_params is None else sampling_params
        if not isinstance(sampling, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(sampling).__name__}")
        if request_id is not None and not isinstance(request_id, (str, int)) or isinstance(request_id, bool):
            raise ValueError(f"request_id must be a string, got {type(request_id).__name__}")
        priority = checks.real("priority", priority)
        arrival = self.clock() if arrival_time is None else checks.real("arrival_time", arrival_time)
        ids, text = self.prompt_ids(prompt)
        self.core.check_request(ids, sampling)
        grammar = self.grammars.compile(sampling.structured) if sampling.structured is not None else None
        k = sampling.prompt_logprobs
        prompt_lp = scored_prompt if scored_prompt is not None or k is None else \
            self.engine.prompt_logprobs(ids, k)  # the n samples share them
        request_id = self._new_request_id() if request_id is None else str(request_id)
        if request_id in self.requests or self.groups.live(request_id):
            raise ValueError(f"duplicate request id {request_id!r}")
        if sampling.num_samples == 1:
            self._add(request_id, ids, sampling, arrival, priority, text, self._request_seed(request_id, sampling),
                      grammar=grammar, prompt_lp=prompt_lp)
            return request_id
        samples = SampleGroups.sample_params(sampling, self._request_seed(request_id, sampling))
        children = [f"{request_id}/{i}" for i in range(len(samples))]
        if any(c in self.requests for c in children):
            raise ValueError(f"request id {request_id!r} clashes with a live request's samples")
        first = None
        for child, child_sampling in zip(children, samples):
            r = self._add(child, ids, child_sampling, arrival, priority, text, child_sampling.seed, fork_of=first,
                          grammar=grammar, prompt_lp=prompt_lp)
            first = first or r
        self.groups.add(request_id, children, sampling)
        return request_id

    def _add(self, request_id, ids, sampling, arrival, priority, text, seed, fork_of=None, grammar=None,
             prompt_lp=None) -> Request:
        grammar = None if grammar is None else self.grammars.state(grammar)
        request = Request(request_id, ids, sampling, arrival, priority=priority, prompt=text, seed=seed,
                          fork_of=fork_of, grammar=grammar, prompt_logprobs=prompt_lp)
        self.requests[request_id] = request
        self._emitted[request_id] = 0
        self.core.add(request)
        return request

    def has_request(self, request_id: str) -> bool:
        """Whether `request_id` (a request, or a group of samples) is still live."""
        return request_id in self.requests or self.groups.live(request_id)

    def abort(self, request_id: str, index: int | None = None):
        """Abort a live request; returns its final output. For a request with n > 1 samples:
        sample `index` alone (its output), or with no index every live sample (their outputs)."""
        request_id = str(request_id)
        group = self.groups.groups.get(request_id)
        if group is not None:
            ids = group.children if index is None else group.children[checks.integer("index", index, 0):][:1]
            live = [self.requests[c] for c in ids if c in self.requests and not self.requests[c].finished]
            if not live:
                raise ValueError(f"cannot abort unknown or finished sample {index} of {request_id!r}")
            for r in live:
                self.core.abort(r)
            raw = [self._release(r, self._output(r)) for r in live]
            outputs = [self.groups.relabel(o) for o in raw]  # before the group's last sample drops it
            for r, o in zip(live, raw):
                self.groups.on_output(r.request_id, o)
            return outputs if index is None else outputs[0]
        request = self.requests.get(request_id)
        if request is None or request.finished:
            raise ValueError(f"cannot abort unknown or finished request {request_id!r}")
        self.core.abort(request)
        return self._release(request, self._output(request))

    def _release(self, request: Request, output: RequestOutput) -> RequestOutput:
        del self.requests[request.request_id]
        del self._emitted[request.request_id]
        return output

    def reset_stats(self) -> None:
        """Start `stats` afresh (a timed run after a warm-up one)."""
        self.core.stats = StepStats()

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished()

    def drain(self, draining: bool = True) -> None:
        """No more arrivals are coming (offline generation): static may run a partial batch."""
        self.core.drain(draining)

    def warmup(self) -> int:
        """Compile every program this configuration can reach (so timings exclude
        compilation): the step per token bucket. Returns the number of model programs."""
        return self.core.warmup()

    def wait_for_compiles(self) -> int:
        """Block until the programs compiling in the background are ready (on a GPU, the narrower
        sampler variants: runtime/step_programs.py), as a benchmark does before it times.
        Returns how many there were."""
        return self.engine.compiled.wait()

    # ---------------------------------------------------------------- step
    def step(self) -> list[RequestOutput]:
        """One scheduling round. Returns an output for every request that got new tokens or
        finished in this round."""
        touched, self._finished_unreturned = self._finished_unreturned + self.core.run_round(), []
        return self._hand_back(touched, stream=True)

    def _hand_back(self, requests: list[Request], stream: bool) -> list[RequestOutput]:
        """Outputs of `requests` (the finished ones released), a group's samples under its id."""
        outputs = []
        for r in requests:
            output = self._output(r, stream=stream)
            if r.finished:
                self._release(r, output)
            if r.request_id in self.groups.sample_of:
                outputs += self.groups.on_output(r.request_id, output)
            else:
                outputs.append(output)
        return outputs

    def finish_round(self) -> list[Request]:
        """One round without building outputs; returns the requests that finished in it."""
        return [r for r in self.core.run_round() if r.finished]

    def _output(self, r: Request, stream: bool = False) -> RequestOutput:
        since = None
        if stream:
            since, self._emitted[r.request_id] = self._emitted.get(r.request_id, 0), len(r.output_token_ids)
        return request_output(r, self.tokenizer, since)

    def error_output(self, request_id: str, prompt, message: str) -> RequestOutput:
        """The output of a request refused with `message`."""
        return error_output(self.clock(), request_id, prompt, message)

    # ------------------------------------------------------------- offline
    def generate(self, prompts: Sequence[Prompt] | Prompt,
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, desc: str | None = None) -> list[RequestOutput]:
        """Run prompts to completion; outputs in input order. A bad prompt gets an
        `error` output with its message; the others run unharmed."""
        workload = offline_workload(prompts, sampling_params)
        bar = progress_bar(len(workload), use_tqdm, desc or self._desc())
        ids, errors = [], {}  # request ids in order (None: refused), refusals' messages by index
        for i, (_, prompt, sampling) in enumerate(workload):
            try:
                ids.append(self.add_request(prompt, sampling))
            except ValueError as e:
                ids.append(None)
                errors[i] = str(e)
                bar.update(1)
        return self._collect(ids, errors, drive(self.core, self.clock, bar), workload)

    def _collect(self, ids, errors, finished, workload) -> list[RequestOutput]:
        """Outputs in workload order. Requests added online that finished while this call drove
        the loop are kept for the next `step()`."""
        mine = set(ids)
        self._finished_unreturned += [r for r in finished if r.request_id not in mine
                                      and self.groups.sample_of.get(r.request_id, ("",))[0] not in mine]
        return [self.error_output(f"error-{i}", workload[i][1], errors[i]) if i in errors
                else self._group_output(rid) if self.groups.live(rid)
                else self._release(self.requests[rid], self._output(self.requests[rid]))
                for i, rid in enumerate(ids)]

    def _group_output(self, group_id: str) -> RequestOutput:
        return self.groups.collect(group_id, lambda c: self._release(self.requests[c], self._output(self.requests[c])))

    def run_until_done(self, use_tqdm: bool = False) -> list[RequestOutput]:
        """Step until every request has finished; returns (and releases) the outputs of the
        requests that finished meanwhile, in the order they finished."""
        finished = self._finished_unreturned + drive(self.core, self.clock, progress_bar(None, use_tqdm, self._desc()))
        self._finished_unreturned = []
        return self.outputs_of(finished)

    def outputs_of(self, finished: list[Request]) -> list[RequestOutput]:
        """Hand back (and release) the outputs of requests that finished in rounds run
        outside `step` (`finish_round`, the engine core's `run_round`)."""
        return self._hand_back(finished, stream=False)

    def _desc(self) -> str:
        return self.scheduler_config.policy + ("-paged" if self.pages is not None else "")

    # -------------------------------------------------------------- replay
    def replay(self, workload: Sequence[tuple[float, Prompt, SamplingParams]], use_tqdm: bool = True,
               desc: str | None = None, concurrency: int | None = None) -> list[RequestOutput]:
        """Admit each `(arrival_offset_s, prompt, sampling)` at its time on the wall clock (or,
        with `concurrency`, from a closed-loop client); outputs in workload order."""
        bar = progress_bar(len(workload), use_tqdm, desc or f"replay {self.scheduler_config.policy}")
        ids, errors, finished = run_arrivals(self, workload, bar, concurrency=concurrency)
        return self._collect(ids, errors, finished, workload)


def request_output(r: Request, tokenizer, since: int | None = None) -> RequestOutput:
    """`r`'s output; streamed (`since`: the tokens already handed out), with only the new tokens
    in `new_token_ids` and their logprobs, and text once it has finished."""
    tokens = list(r.output_token_ids)
    new = tokens[since:] if since is not None else []
    text = None
    if tokenizer is not None and tokens and r.finished:  # streamed steps carry new_token_ids only
        text = tokenizer.decode(tokens, skip_special_tokens=True)
    reason = None if r.finish_reason is None else r.finish_reason.value
    logprobs = cumulative = None
    if r.sampling.logprobs is not None:
        logprobs = r.logprobs[len(tokens) - len(new):] if since is not None else list(r.logprobs)
        cumulative = r.cumulative_logprob
    return RequestOutput(r.request_id, list(r.prompt_token_ids), tokens, text, reason, r.metrics, prompt=r.prompt,
                         error=r.error, new_token_ids=new, logprobs=logprobs, cumulative_logprob=cumulative,
                         prompt_logprobs=r.prompt_logprobs if not since else None)


def prompt_token_ids(tokenizer, prompt: Prompt) -> tuple[list[int], str | None]:
    """A prompt's token ids, and its text when it was one."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("this model has no tokenizer: pass prompts as lists of token ids")
        return list(tokenizer(prompt)["input_ids"]), prompt
    if isinstance(prompt, (bytes, bytearray, memoryview)) or not hasattr(prompt, "__iter__"):
        raise ValueError(f"a prompt must be a string or a sequence of integer token ids, "
                         f"got {type(prompt).__name__}")
    if type(prompt) is list and all(type(t) is int for t in prompt):  # the common case, without a call per id
        return list(prompt), None
    return [checks.integer("a prompt token id", t) for t in prompt], None


def offline_workload(prompts, sampling_params) -> list[tuple[float, Prompt, SamplingParams | None]]:
    """`generate`'s arguments as a workload of arrivals at 0: one prompt or a list, one
    `SamplingParams` for all or one each."""
    if isinstance(prompts, str) or (len(prompts) > 0 and _is_int_list(prompts)):
        prompts = [prompts]
    prompts = list(prompts)
    if sampling_params is None or isinstance(sampling_params, SamplingParams):
        sampling_list = [sampling_params] * len(prompts)
    else:
        sampling_list = list(sampling_params)
        if len(sampling_list) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(sampling_list)} sampling params")
    return [(0.0, p, s) for p, s in zip(prompts, sampling_list)]


def _is_int_list(x) -> bool:
    try:
        return len(x) > 0 and all(isinstance(t, int) or hasattr(t, "__index__") for t in x) \
            and not isinstance(x, str)
    except TypeError:
        return False


def error_output(now: float, request_id: str, prompt, message: str) -> RequestOutput:
    """The output of a request refused with `message` at `now`."""
    ids = list(prompt) if not isinstance(prompt, (str, bytes, bytearray)) and _is_int_list(prompt) else []
    metrics = RequestMetrics(arrival_time=now, finish_time=now)
    return RequestOutput(request_id, ids, [], None, FinishReason.ERROR.value, metrics,
                         prompt=prompt if isinstance(prompt, str) else None, error=message)

"""The front door: `LLM(model, **engine_args)`. Requests in, outputs out.

Offline: `generate(prompts, sampling_params)`. Online: `add_request` / `step` /
`abort` / `has_unfinished_requests`, with each step's new tokens streamed back.
`replay(workload)` admits each request at its arrival time on the wall clock. The
rounds themselves run in the engine core (cbjax/core/engine_core.py).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Sequence

from cbjax import checks, compile_cache
from cbjax.core import EngineArgs, StepStats, build_core
from cbjax.core.disaggregation import build_disaggregated
from cbjax.core.interface import Core
from cbjax.core.replay import run_arrivals, sleep_until
from cbjax.core.request_book import RequestBook, SampleGroups
from cbjax.front import Prompt
from cbjax.grammar import Grammars
from cbjax.loading import Model
from cbjax.request import Request, RequestOutput, SamplingParams, error_output, is_int_list
from cbjax.runtime.prompt_logprobs import PromptScorer
from cbjax.prompt_scores import PromptScores


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


class OfflineRuns:
    """A front's workloads run to completion: `generate` (every prompt at once), `replay`
    (each at its arrival time) and `run_until_done`. `LLM` is the front; this is the loop
    that drives its core until the workload has finished (through the front's `add_request`
and `error_output`)."""

    core: Core
    book: RequestBook
    clock: Callable[[], float]
    args: EngineArgs

    def generate(self, prompts: Sequence[Prompt] | Prompt,
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, desc: str | None = None,
                 lora: str | Sequence[str | None] | None = None) -> list[RequestOutput]:
        """Run prompts to completion; outputs in input order. A bad prompt gets an
        `error` output with its message; the others run unharmed. `lora`: the LoRA adapter
        (`load_lora`) of every prompt, or one per prompt; None: the base model."""
        workload = offline_workload(prompts, sampling_params)
        loras = per_prompt_lora(lora, len(workload))
        bar = progress_bar(len(workload), use_tqdm, desc or self._desc())
        ids, errors = [], {}  # request ids in order (None: refused), refusals' messages by index
        for i, (_, prompt, sampling) in enumerate(workload):
            try:
                ids.append(self.add_request(prompt, sampling, lora=loras[i]))
            except ValueError as e:
                ids.append(None)
                errors[i] = str(e)
                bar.update(1)
        return self._collect(ids, errors, drive(self.core, self.clock, bar), workload)

    def _collect(self, ids, errors, finished, workload) -> list[RequestOutput]:
        """Outputs in workload order. Requests added online that finished while this call drove
        the loop are kept for the next `step()`."""
        self.book.keep_others(ids, finished)
        return [self.error_output(f"error-{i}", workload[i][1], errors[i]) if i in errors
                else self.book.final_output(rid) for i, rid in enumerate(ids)]

    def run_until_done(self, use_tqdm: bool = False) -> list[RequestOutput]:
        """Step until every request has finished; returns (and releases) the outputs of the
        requests that finished meanwhile, in the order they finished."""
        finished = self.book.take_unreturned()
        finished += drive(self.core, self.clock, progress_bar(None, use_tqdm, self._desc()))
        return self.outputs_of(finished)

    def outputs_of(self, finished: list[Request]) -> list[RequestOutput]:
        """Hand back (and release) the outputs of requests that finished in rounds run
        outside `step` (`finish_round`, the engine core's `run_round`)."""
        return self.book.hand_back(finished, stream=False)

    def _desc(self) -> str:
        return self.args.policy + ("-paged" if self.args.kv_cache == "paged" else "")

    def replay(self, workload: Sequence[tuple[float, Prompt, SamplingParams]], use_tqdm: bool = True,
               desc: str | None = None, concurrency: int | None = None) -> list[RequestOutput]:
        """Admit each `(arrival_offset_s, prompt, sampling)` at its time on the wall clock (or,
        with `concurrency`, from a closed-loop client); outputs in workload order."""
        bar = progress_bar(len(workload), use_tqdm, desc or f"replay {self.args.policy}")
        ids, errors, finished = run_arrivals(self, workload, bar, concurrency=concurrency)
        return self._collect(ids, errors, finished, workload)


class LLM(OfflineRuns):
    def __init__(self, model: str | Model, args: EngineArgs | None = None, *,
                 clock: Callable[[], float] = time.perf_counter, simulate=None, devices: Sequence | None = None,
                 mesh=None, core: Core | None = None, **engine_args):
        """`engine_args`: the fields of `EngineArgs` (cbjax/core/engine_args.py documents each),
        or a ready `args` (keywords then override its fields).

        `simulate`: run on the scheduling simulator instead of the device, an accelerator
        name (roofline) or a calibration file or cost model (cbjax.simulator); time is then
        simulated, and `model` may name a shape from cbjax.simulator.MODEL_SHAPES.
        `tensor_parallel`: shard the params and the KV cache over that many of `devices`
        (default: `jax.devices()`, every process's); or pass a ready `mesh` with a "tp" axis
        (runtime/scale/sharding.py). `devices` alone pins a single-device engine to `devices[0]`.
        `pipeline_stages`: split the layers over that many devices instead, decoding the
        slots in `micro_batches` groups (runtime/scale/pipeline.py). `prefill_instances`: prefill and decode apart.
        `core`: one built apart from `model` (a `Model`) and `args` (`build_core`), for a study that
        reads the engine behind it through the core's own surface (`Core`, cbjax/core/interface.py)."""
        args = EngineArgs(**engine_args) if args is None else dataclasses.replace(args, **engine_args)
        self.args = args
        compile_cache.enable()  # a directory already chosen (the server's flag, a test's) is kept
        build = build_disaggregated if args.prefill_instances else build_core
        self.model, self.core = (model, core) if core is not None else \
            build(model, args, clock=clock, simulate=simulate, devices=devices, mesh=mesh)
        self.tokenizer = self.model.tokenizer
        self.clock = self.core.clock
        self.book = RequestBook(self.tokenizer, args.seed)  # the live requests
        # Structured output's compiler (llguidance over the tokenizer, read on first use).
        self.grammars = Grammars(self.tokenizer, self.model.config.vocab_size, tuple(self.model.config.eos_token_ids))
        for name, path in args.lora_paths().items():
            self.load_lora(name, path)

    def load(self):  # what the engine holds after its latest round (`cbjax.core.engine_core.Load`)
        return self.core.load()

    def snapshot(self):
        """A read-only copy of what the core holds (`cbjax.core.snapshot.Snapshot`)."""
        return self.core.snapshot()

    scheduler_config = property(lambda self: self.args.scheduler_config(self.engine_info.num_slots))
    stats = property(lambda self: self.core.stats)  # `StepStats`: where the rounds' time went
    idle = property(lambda self: self.core.idle)
    wake_time = property(lambda self: self.core.wake_time)
    requests = property(lambda self: self.book.requests)  # live requests by id
    max_model_len = property(lambda self: self.engine_info.max_model_len)  # tokens of one sequence: prompt and output
    engine_info = property(lambda self: self.core.info())  # `EngineInfo`: platform, attention, slots...
    data_parallel = 1  # engines behind this front (`Replicas`: several)

    # ------------------------------------------------------------ requests
    def prompt_ids(self, prompt: Prompt) -> tuple[list[int], str | None]:
        return prompt_token_ids(self.tokenizer, prompt)

    def add_request(self, prompt: Prompt, sampling_params: SamplingParams | None = None, *,
                    request_id: str | None = None, priority: float = 0, arrival_time: float | None = None,
                    scored_prompt: list | None = None, lora: str | None = None) -> str:
        """Queue a request; raises ValueError for a bad one (nothing else is touched).
        `scored_prompt`: its prompt logprobs, when the caller computed them (`engine.prompt_scorer`);
        `lora`: the name of a loaded LoRA adapter to run it with (None: the base model)."""
        sampling = SamplingParams() if sampling_params is None else sampling_params
        if not isinstance(sampling, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(sampling).__name__}")
        if request_id is not None and not isinstance(request_id, (str, int)) or isinstance(request_id, bool):
            raise ValueError(f"request_id must be a string, got {type(request_id).__name__}")
        priority = checks.real("priority", priority)
        arrival = self.clock() if arrival_time is None else checks.real("arrival_time", arrival_time)
        ids, text = self.prompt_ids(prompt)
        self.core.check_request(ids, sampling)
        salt = self.core.lora_salt(lora) if lora is not None else 0
        grammar = self.grammars.compile(sampling.structured) if sampling.structured is not None else None
        prompt_lp, scores = self._prompt_logprobs(ids, sampling, scored_prompt)  # the n samples share them
        request_id = self.book.new_id(request_id)
        if sampling.num_samples == 1:
            self._add(request_id, ids, sampling, arrival, priority, text, self.book.seed_of(request_id, sampling),
                      grammar=grammar, prompt_lp=prompt_lp, scores=scores, lora=(lora, salt))
            return request_id
        samples = SampleGroups.sample_params(sampling, self.book.seed_of(request_id, sampling))
        children = self.book.sample_ids(request_id, len(samples))
        first = None
        for child, child_sampling in zip(children, samples):
            r = self._add(child, ids, child_sampling, arrival, priority, text, child_sampling.seed, fork_of=first,
                          grammar=grammar, prompt_lp=prompt_lp, scores=scores, lora=(lora, salt))
            first = first or r
        self.book.groups.add(request_id, children, sampling)
        return request_id

    def _prompt_logprobs(self, ids: list[int], sampling: SamplingParams,
                         scored: list | None) -> tuple[list | None, PromptScores | None]:
        """A request's prompt logprobs when asked for: the caller's (`scored`), else computed
        now where the engine's step does not score prompts; or the `PromptScores` its step fills."""
        k, first = sampling.prompt_logprobs, sampling.prompt_logprobs_from
        if k is None:
            return None, None
        if scored is None and self.core.scores_prompts:
            return None, PromptScores(ids, k, first)
        scored = scored if scored is not None else self.core.prompt_scorer(ids, k).run()
        return [None if p < first else entry for p, entry in enumerate(scored)], None

    def _add(self, request_id, ids, sampling, arrival, priority, text, seed, fork_of=None, grammar=None,
             prompt_lp=None, scores=None, lora=(None, 0)) -> Request:
        grammar = None if grammar is None else self.grammars.state(grammar)
        request = Request(request_id, ids, sampling, arrival, priority=priority, prompt=text, seed=seed,
                          fork_of=fork_of, grammar=grammar, prompt_logprobs=prompt_lp, prompt_scores=scores,
                          lora=lora[0], prefix_salt=lora[1])
        self.book.add(request)
        self.core.add(request)
        return request

    # ------------------------------------------------------------ LoRA adapters
    def load_lora(self, name: str, path: str) -> None:
        """Load a PEFT LoRA adapter directory as `name` (enable_lora); refused, naming it, when the
        engine cannot apply it. Requests name it by `lora=`."""
        self.core.load_lora(name, str(path))

    def unload_lora(self, name: str) -> None:
        """Forget adapter `name`; refused while a request waits for it or runs it."""
        self.core.unload_lora(name)

    def lora_adapters(self) -> list[str]:
        """The loaded LoRA adapters' names."""
        return self.core.lora_adapters()

    def has_request(self, request_id: str) -> bool:
        """Whether `request_id` (a request, or a group of samples) is still live."""
        return self.book.live(request_id)

    def abort(self, request_id: str, index: int | None = None):
        """Abort a live request; returns its final output. For a request with n > 1 samples:
        sample `index` alone (its output), or with no index every live sample (their outputs)."""
        request_id = str(request_id)
        index = None if index is None else checks.integer("index", index, 0)
        whole_group = index is None and self.book.groups.live(request_id)
        aborted = self.book.to_abort(request_id, index)
        for r in aborted:
            self.core.abort(r)
        outputs = self.book.aborted_outputs(request_id, aborted)
        return outputs if whole_group else outputs[0]

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
        sampler variants: runtime/compiled/step_programs.py), as a benchmark does before it times.
        Returns how many there were."""
        return self.core.wait_for_compiles()

    def warm_structured_output(self, background: bool = False) -> int:
        """Compile the programs structured-output requests run (`warmup` leaves them out), now or
        (`background`) on a thread of their own. Returns how many; 0 where the engine has none."""
        return self.core.warm_structured_output(background)

    def prompt_scorer(self, prompt: Prompt, sampling: SamplingParams) -> PromptScorer | None:
        """For a request asking for prompt logprobs: checks it (ValueError) and returns the scorer
        that computes them a chunk at a time, for `add_request(..., scored_prompt=)`; None where
        the engine's step scores them (`add_request` then queues it as it is)."""
        ids, _ = self.prompt_ids(prompt)
        self.core.check_request(ids, sampling)
        return None if self.core.scores_prompts else self.core.prompt_scorer(ids, sampling.prompt_logprobs)

    def watch_arrivals(self, pending: Callable[[], bool]) -> None:
        """`pending()`: whether requests have arrived that the front has not handed in yet (a
        server's queue): a decode call then waits for them rather than running ahead."""
        self.core.arrivals_pending = pending

    def use_length_predictor(self, predict: Callable[[list[int]], int] | None) -> None:
        """Prompt token ids -> expected output tokens, for the length-aware orderings (a
        trace's known lengths, a `LengthPredictor`); None: requests carry max_tokens only."""
        self.core.predict_len = predict

    # ---------------------------------------------------------------- step
    def step(self) -> list[RequestOutput]:
        """One scheduling round. Returns an output for every request that got new tokens or
        finished in this round."""
        return self.book.hand_back(self.book.take_unreturned() + self.core.run_round(), stream=True)

    def finish_round(self) -> list[Request]:
        """One round without building outputs; returns the requests that finished in it."""
        return [r for r in self.core.run_round() if r.finished]

    def error_output(self, request_id: str, prompt, message: str) -> RequestOutput:
        """The output of a request refused with `message`."""
        return error_output(self.clock(), request_id, prompt, message)


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
    if isinstance(prompts, str) or (len(prompts) > 0 and is_int_list(prompts)):
        prompts = [prompts]
    prompts = list(prompts)
    if sampling_params is None or isinstance(sampling_params, SamplingParams):
        sampling_list = [sampling_params] * len(prompts)
    else:
        sampling_list = list(sampling_params)
        if len(sampling_list) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(sampling_list)} sampling params")
    return [(0.0, p, s) for p, s in zip(prompts, sampling_list)]


def per_prompt_lora(lora, num_prompts: int) -> list[str | None]:
    """`generate`'s `lora=`: one adapter name (or None) for every prompt, or a list of one per prompt."""
    if lora is None or isinstance(lora, str):
        return [lora] * num_prompts
    loras = list(lora)
    if len(loras) != num_prompts or not all(x is None or isinstance(x, str) for x in loras):
        raise ValueError(f"lora must be an adapter name, None, or one of those per prompt ({num_prompts}), "
                         f"got {lora!r}")
    return loras

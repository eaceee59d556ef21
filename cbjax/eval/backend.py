"""The `cbjax` model of lm-evaluation-harness: its three request types run on the engine.

- `loglikelihood`: each (context, continuation) as one prompt whose prompt log-probabilities
  the engine computes (`SamplingParams.prompt_logprobs`); the continuation's tokens summed,
  and greedy when every one of them is its position's likeliest token. Too long a request is
  truncated from the left as lm-eval's `hf` model does (the last `max_length + 1` tokens).
- `loglikelihood_rolling`: lm-eval's rolling windows of a document (each window's tokens
  predicted once, with as much context as `max_length` allows), scored as above and summed.
- `generate_until`: every request in the engine at once, continuous batching; a request
  stops at any of its `until` strings (aborted there, its text cut before it), at
  `max_gen_toks` or at EOS. Greedy unless `do_sample` or a temperature asks otherwise.

Tokenization is lm-eval's `hf` model's: the tokenizer's own special tokens unless
`add_bos_token` says otherwise.
"""

from __future__ import annotations

import dataclasses

from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tqdm.auto import tqdm
from typing_extensions import override

from cbjax import LLM, EngineArgs, SamplingParams

# The backend's engine defaults where they differ from the engine's own: the paged cache and
# its prefix caching (a task's choices share their context).
EVAL_DEFAULTS = {"kv_cache": "paged", "enable_prefix_caching": True}
OWN_ARGS = ("pretrained", "add_bos_token", "max_gen_toks", "max_length", "batch_size", "max_batch_size", "device")


def engine_args(kwargs: dict, max_length: int | None = None) -> dict:
    """The `EngineArgs` fields among lm-eval's `model_args`; an unknown key is refused, named.
    `max_length` without a `max_seq_len`: the engine's length holds it (and the two tokens a
    request adds: its first, predicted by nothing, and the one it generates), in whole pages."""
    fields = {f.name for f in dataclasses.fields(EngineArgs)}
    unknown = sorted(k for k in kwargs if k not in fields)
    if unknown:
        raise ValueError(f"unknown model_args for cbjax: {', '.join(unknown)} (known: {', '.join(OWN_ARGS)} "
                         f"and the fields of cbjax.EngineArgs)")
    args = {**EVAL_DEFAULTS, **kwargs}
    if max_length is not None and "max_seq_len" not in args:
        page = int(args.get("page_size", EngineArgs.page_size))
        args["max_seq_len"] = -(-(int(max_length) + 2) // page) * page
    return args


@register_model("cbjax")
class CbjaxLM(TemplateLM):
    """`pretrained`: a preset name, a Hugging Face directory, a GGUF file, an orbax directory or
    a training run's checkpoint (`LLM`'s model argument); `max_length` as the `hf` model's (the
    longest scored sequence); every other model_arg is an `EngineArgs` field. `batch_size` is
    accepted and ignored: the engine batches by its slots (`num_slots`)."""

    def __init__(self, pretrained: str = "smollm2-135m", add_bos_token: bool | None = None, max_gen_toks: int = 256,
                 max_length: int | None = None, batch_size=None, max_batch_size=None, device=None, **kwargs):
        super().__init__()
        self.llm = LLM(pretrained, **engine_args(kwargs, max_length))
        if max_length is not None and int(max_length) + 2 > self.llm.args.max_seq_len:
            raise ValueError(f"max_length={max_length} needs max_seq_len >= {int(max_length) + 2}, "
                             f"got {self.llm.args.max_seq_len}")
        self._max_length = None if max_length is None else int(max_length)
        if self.llm.tokenizer is None:
            raise ValueError(f"{pretrained!r} has no tokenizer: lm-eval's tasks are text")
        self.tokenizer = self.llm.tokenizer
        self.add_bos_token = add_bos_token
        self.max_gen_toks = int(max_gen_toks)

    @property
    @override
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def max_length(self) -> int:
        """Tokens a scored sequence predicts at most: `max_length` when given, else the engine's
        length less the prompt's first token and the one token a request must generate."""
        return self.llm.args.max_seq_len - 2 if self._max_length is None else self._max_length

    @property
    @override
    def prefix_token_id(self) -> int:
        """What an empty context and the first rolling window are conditioned on: BOS, else EOS."""
        bos = self.tokenizer.bos_token_id
        return self.eot_token_id if bos is None else bos

    @override
    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        """The `hf` model's: the tokenizer's own special tokens unless told (`add_bos_token`),
        none when the text already starts with BOS's."""
        special = self.add_bos_token if add_special_tokens is None else add_special_tokens
        if add_special_tokens is None and string.startswith(self.tok_decode([self.prefix_token_id], False)):
            special = False
        return self.tokenizer.encode(string, **({} if special is None else {"add_special_tokens": special}))

    def tok_decode(self, tokens: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=skip_special_tokens)

    @override
    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        prompts, scored = [], []
        for _, context, continuation in requests:
            whole = (list(context) + list(continuation))[-(self.max_length + 1):]
            prompts.append(whole)
            scored.append(min(len(continuation), len(whole) - 1))
        outs = self._score(prompts, [len(p) - n for p, n in zip(prompts, scored)], disable_tqdm)
        results = []
        for (cache_key, _, _), out, n in zip(requests, outs, scored):
            if out.error is not None:
                raise ValueError(f"cbjax could not score a request: {out.error}")
            tail = out.prompt_logprobs[len(out.prompt_logprobs) - n:]
            answer = (float(sum(t.logprob for t in tail)), all(t.rank == 1 for t in tail))
            if cache_key is not None:
                self.cache_hook.add_partial("loglikelihood", cache_key, answer)
            results.append(answer)
        return results

    def _score(self, prompts: list[list[int]], firsts: list[int], disable_tqdm: bool) -> list:
        """Each prompt's output with its prompt logprobs from position `firsts[i]` on. With the
        prefix cache, in two waves: first one prompt of each context (the tokens before its
        first scored position), then the rest, whose contexts the cache then holds (requests
        admitted in one round would each compute theirs)."""
        waves = [list(range(len(prompts)))]
        if self.llm.args.enable_prefix_caching:
            first_of_context: dict = {}
            for i, (prompt, first) in enumerate(zip(prompts, firsts)):
                first_of_context.setdefault(tuple(prompt[:first]), i)
            leaders = sorted(first_of_context.values())
            waves = [leaders, sorted(set(waves[0]) - set(leaders))]
        outs: list = [None] * len(prompts)
        for n, wave in enumerate(w for w in waves if w):
            done = self.llm.generate([prompts[i] for i in wave],
                                     [SamplingParams(max_tokens=1, prompt_logprobs=0, prompt_logprobs_from=firsts[i])
                                      for i in wave], use_tqdm=not disable_tqdm,
                                     desc=f"Running loglikelihood requests ({n + 1}/{len(waves)})")
            for i, out in zip(wave, done):
                outs[i] = out
        return outs

    @override
    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        windows, owners = [], []
        for i, (string,) in enumerate(req.args for req in requests):
            for context, continuation in map(make_disjoint_window, get_rolling_token_windows(
                    token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length, context_len=1)):
                windows.append((None, context, continuation))
                owners.append(i)
        totals = [0.0] * len(requests)
        for i, (logprob, _) in zip(owners, self._loglikelihood_tokens(windows, disable_tqdm=disable_tqdm)):
            totals[i] += logprob
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", (req.args[0],), total)
        return totals

    @override
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        ids, stops = [], []
        for req in requests:
            context, gen_kwargs = req.args
            sampling, until = self.sampling(dict(gen_kwargs))
            # The hf model's cut: the context's last `max_length - max_gen_toks` tokens.
            prompt = self.tok_encode(context)[-max(self.max_length - sampling.max_tokens, 1):]
            ids.append(self.llm.add_request(prompt, sampling))
            stops.append(until)
        texts = run_with_stops(self.llm, ids, stops, self.tok_decode, disable_tqdm)
        for req, text in zip(requests, texts):
            self.cache_hook.add_partial("generate_until", req.args, text)
        return texts

    def sampling(self, gen_kwargs: dict) -> tuple[SamplingParams, list[str]]:
        """lm-eval's generation kwargs as `SamplingParams` and the stop strings (EOS's text
        among them, as the `hf` model does): greedy unless `do_sample`; a kwarg the engine
        has no such field for is refused, named."""
        until = gen_kwargs.pop("until", None) or []
        until = [until] if isinstance(until, str) else list(until)
        eos = self.tok_decode([self.eot_token_id], False)
        if eos and eos not in until:
            until.append(eos)
        max_tokens = min(int(gen_kwargs.pop("max_gen_toks", self.max_gen_toks)), self.llm.args.max_seq_len - 1)
        do_sample = bool(gen_kwargs.pop("do_sample", False))
        temperature = float(gen_kwargs.pop("temperature", 1.0))
        temperature = temperature if do_sample else 0.0
        known = {f.name for f in dataclasses.fields(SamplingParams)}
        unknown = sorted(k for k in gen_kwargs if k not in known)
        if unknown:
            raise ValueError(f"generation kwargs cbjax does not take: {', '.join(unknown)}")
        return SamplingParams(max_tokens=max_tokens, temperature=temperature, **gen_kwargs), until


def run_with_stops(llm: LLM, ids: list[str], stops: list[list[str]], decode, disable_tqdm: bool) -> list[str]:
    """Step the engine until every request in `ids` ends: at EOS or its max_tokens, or at the
    first of its stop strings in its text (aborted there, the text cut before the stop)."""
    where = {rid: i for i, rid in enumerate(ids)}
    tokens: list[list[int]] = [[] for _ in ids]
    texts: list[str | None] = [None] * len(ids)
    bar = tqdm(total=len(ids), disable=disable_tqdm, desc="Running generate_until requests")
    while any(t is None for t in texts):
        for out in llm.step():
            i = where.get(out.request_id)
            if i is None or texts[i] is not None:
                continue
            tokens[i] += out.new_token_ids
            text = decode(tokens[i])
            cut = min((text.index(s) for s in stops[i] if s and s in text), default=None)
            if cut is not None or out.finished:
                if not out.finished:
                    llm.abort(out.request_id)
                texts[i] = text if cut is None else text[:cut]
                bar.update(1)
    bar.close()
    return [t or "" for t in texts]

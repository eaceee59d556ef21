"""A draft model's proposals for speculative decoding: a second, smaller model with the target's
vocabulary, on an engine and KV cache of its own, slot for slot with the target's.

Each round, for the requests that speculate, the draft catches up on what it has not seen
(one prompt-like row per request, from the first position whose keys it holds wrongly or not
at all; a rejected proposal's positions are simply written over), samples its first proposed
token greedily at the row's end, then runs `k - 1` one-step decode calls that feed themselves
on the device; the host reads every call's tokens once. Greedy proposals are point masses,
for which the target's verification (cbjax/runtime/traced/speculative.py) is exact rejection
sampling: the outputs keep the target's distribution. A guess's confidence is the draft's own
probability of its least likely token, in tenths.
"""

from __future__ import annotations

import math

import jax

from cbjax.request import Request, SamplingParams
from cbjax.runtime.engine import Engine, EngineConfig
from cbjax.runtime.packing import split_logprobs, to_host
from cbjax.scheduling.plan import Row
from cbjax.scheduling.speculation import check_draft_vocabulary
from cbjax.scheduling.speculation_length import NO_GUESS, Guess


class DraftProposer:
    costly = True

    def __init__(self, model, target_config, config: EngineConfig):
        """`model`: the loaded draft; `target_config`: the target's `ModelConfig` (the vocabulary
        must match); `config`: the draft engine's knobs (the target's slots and length)."""
        check_draft_vocabulary(model.config.vocab_size, target_config.vocab_size)
        self.engine = Engine(model, config)
        self.greedy = SamplingParams(max_tokens=config.max_seq_len, ignore_eos=True, logprobs=0)
        # request id -> (its slot, tokens it had when last proposed for, that proposal); the draft's
        # cache then held those tokens' keys, and the proposal's but its last
        self._seen: dict[str, tuple[int, int, list[int]]] = {}

    def warmup(self) -> int:
        return self.engine.warmup()

    def _valid(self, r: Request, tokens: list[int]) -> int:
        """Leading positions of `r` whose keys the draft's cache holds correctly."""
        slot, known, proposal = self._seen.get(r.request_id, (None, 0, []))
        if slot != r.slot:
            return 0
        agreed = 0  # the proposal's keys are right up to the first token the target rejected
        ahead = tokens[known:]
        while agreed < min(len(proposal) - 1, len(ahead)) and ahead[agreed] == proposal[agreed]:
            agreed += 1
        return min(known + agreed, len(tokens) - 1)

    def propose(self, requests: list[Request], ks: list[int]) -> list[Guess]:
        """The draft's greedy tokens, each guess as sure as the draft is of its least likely token."""
        todo = [(r, k) for r, k in zip(requests, ks) if k > 0]
        if not todo:
            return [NO_GUESS for _ in requests]
        rows = []
        for r, _ in todo:
            tokens = r.prompt_token_ids + r.output_token_ids
            start = self._valid(r, tokens)
            rows.append(Row(r.slot, tokens[start:], start, is_last=True, sampling=self.greedy,
                            prompt_len=r.prompt_len))
        calls = [self.engine.run(rows)]
        steps = max(k for _, k in todo) - 1
        decodes = [Row(r.slot, [], 0) for r, _ in todo]
        calls += [self.engine.run(decodes) for _ in range(steps)]
        host = to_host([[out for out, _ in call] for call in calls], self.engine.platform)
        drafted = {r.request_id: ([], []) for r, _ in todo}  # request id -> (tokens, their log-probabilities)
        for call, results in zip(calls, host):
            for (_, members), out in zip(call, results):
                tokens, logprobs = split_logprobs(out)
                for j, i in enumerate(members):
                    if i >= 0 and tokens[0, j, 0] >= 0:
                        mine = drafted[todo[i][0].request_id]
                        mine[0].append(int(tokens[0, j, 0]))
                        mine[1].append(float(logprobs[0, j, 0]) if logprobs is not None else 0.0)
        out = []
        for r, k in zip(requests, ks):
            proposal, logprobs = drafted.get(r.request_id, ([], []))
            proposal, logprobs = proposal[:k], logprobs[:k]
            if k > 0:
                self._seen[r.request_id] = (r.slot, r.num_tokens, proposal)
            out.append(Guess(proposal, min(int(10 * math.exp(min(logprobs))), 9) if logprobs else 0))
        return out

    def forget(self, request_id: str) -> None:
        self._seen.pop(request_id, None)


def draft_proposer(spec: str, target, args, num_slots: int) -> DraftProposer:
    """The draft `args.speculative_model` names, loaded as the target was (dtype), on an engine of
    the target's slots and length."""
    from cbjax.loading import load_model

    model = load_model(spec, dtype=args.dtype, with_tokenizer=False)
    config = EngineConfig(num_slots=num_slots, max_seq_len=args.max_seq_len, prefill_floor=args.prefill_floor,
                          kv_cache="slots", max_logprobs=1, cpu_kernels=args.cpu_kernels,
                          max_step_tokens=args.max_step_tokens, min_step_tokens=args.min_step_tokens)
    if jax.devices()[0].platform != "cpu":
        config.attention = args.attention
    return DraftProposer(model, target.config, config)

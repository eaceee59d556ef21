"""Speculative decoding inside continuous batching: verify rows in the ragged step give exactly
the tokens decoding gives (greedy, and seeded sampling: randomness is keyed by the output
index), whatever is proposed; rejected positions leave nothing behind; the host side (n-gram
proposals, the adaptive length) on its own."""

from __future__ import annotations

import numpy as np
import pytest

from cbjax import LLM, SamplingParams
from cbjax.request import Request
from cbjax.scheduling.speculation import NgramProposer, may_speculate
from cbjax.scheduling.speculation_length import AdaptiveLength, Guess, expected_tokens
from tests.tiers import sweep
from tests.internals import engine_of, scheduler_of

MODEL = "tiny-llama"


def prompts(seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    motif = [int(t) for t in rng.integers(3, 250, 10)]
    return [motif * 4,  # repeats: the n-gram proposer has a lot to go on
            [int(t) for t in rng.integers(3, 250, 23)],
            [7, 8, 9, 7, 8, 9, 7, 8],
            [int(t) for t in rng.integers(3, 250, 5)]]


class ScriptedProposer:
    """Proposes the reference continuation with every third proposed token replaced by a wrong
    one (so rows are accepted whole, in part, and not at all), of lengths that differ from row
    to row in one step, and nothing for some rounds."""

    def __init__(self, reference: dict[tuple, list[int]], vocab: int):
        self.reference, self.vocab, self.calls = reference, vocab, 0

    def propose(self, requests, ks):
        return [Guess(self.guess(r, k)) if k else Guess([]) for r, k in zip(requests, ks)]

    def warmup(self):
        return 0

    def guess(self, r: Request, k: int) -> list[int]:
        self.calls += 1
        if self.calls % 5 == 0:
            return []
        ref = self.reference[tuple(r.prompt_token_ids)]
        done = len(r.output_token_ids)
        proposal = list(ref[done:done + k]) or [1] * k
        for i in range((self.calls % 3), len(proposal), 3):
            proposal[i] = (proposal[i] + 1 + self.calls) % self.vocab
        return proposal[:1 + self.calls % k]  # 1..k tokens: rows of different lengths in one step

    def forget(self, request_id: str) -> None:
        pass


def run(sampling, speculate: str = "none", scripted=None, model: str = MODEL, **kwargs):
    llm = LLM(model, max_seq_len=kwargs.pop("max_seq_len", 96), num_slots=kwargs.pop("num_slots", 4),
              speculative_method=speculate, num_speculative_tokens=kwargs.pop("num_speculative_tokens", 4),
              speculative_length="fixed", **kwargs)
    if scripted is not None:
        scheduler_of(llm).speculator.proposer = scripted(llm)
    outs = llm.generate(prompts(), sampling, use_tqdm=False)
    return llm, outs


@pytest.mark.parametrize("kv_cache,merge_mode", sweep([("slots", "prefill_first"), ("paged", "chunked"),
                                                       ("paged", "prefill_first"), ("slots", "fused")],
                                                      quick={("paged", "chunked")}))
def test_verified_tokens_equal_decoding_whatever_is_proposed(kv_cache, merge_mode):
    """Greedy and seeded top-k/top-p sampling: proposals right, wrong and partly right, with
    n-gram and scripted proposers, give the tokens plain decoding gives; a request stops on its
    max_tokens inside an accepted proposal."""
    greedy = [SamplingParams(max_tokens=m) for m in (24, 30, 7, 19)]
    sampled = [SamplingParams(max_tokens=20, temperature=0.9, top_k=40, top_p=0.9, seed=s) for s in range(4)]
    kw = dict(kv_cache=kv_cache, merge_mode=merge_mode)
    if kv_cache == "paged":
        kw["page_size"] = 8
    for sampling in (greedy, sampled):
        _, plain = run(sampling, **kw)
        reference = {tuple(o.prompt_token_ids): o.token_ids for o in plain}
        llm, ngram = run(sampling, "ngram", **kw)
        assert [o.token_ids for o in ngram] == [o.token_ids for o in plain]
        llm, scripted = run(sampling, "ngram", scripted=lambda llm: ScriptedProposer(reference, 256), **kw)
        assert [o.token_ids for o in scripted] == [o.token_ids for o in plain]
        spec = scheduler_of(llm).speculator
        assert spec.proposed > spec.accepted > 0  # both paths were taken
        assert sum(o.metrics.num_draft_tokens for o in scripted) == spec.proposed
        assert sum(o.metrics.num_accepted_tokens for o in scripted) == spec.accepted


def test_accepted_proposals_save_steps_and_the_cache_ends_consistent():
    """Proposals that are the target's own tokens are all accepted: fewer device steps for the
    same tokens; afterwards the engine serves a new batch exactly (nothing left behind)."""
    greedy = SamplingParams(max_tokens=32)
    plain_llm, plain = run(greedy)
    reference = {tuple(o.prompt_token_ids): o.token_ids for o in plain}

    class Oracle(ScriptedProposer):
        def guess(self, r, k):
            done = len(r.output_token_ids)
            return list(self.reference[tuple(r.prompt_token_ids)][done:done + k])

    llm, spec = run(greedy, "ngram", scripted=lambda llm: Oracle(reference, 256))
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert scheduler_of(llm).speculator.accepted == scheduler_of(llm).speculator.proposed > 0
    assert llm.core.stats.decode_steps < plain_llm.core.stats.decode_steps / 3
    scheduler_of(llm).speculator.proposer = NgramProposer()
    again = llm.generate(prompts(1), greedy, use_tqdm=False)
    assert [o.token_ids for o in again] == [o.token_ids for o in plain_llm.generate(prompts(1), greedy,
                                                                                     use_tqdm=False)]


def test_logprobs_and_stop_tokens_through_verification():
    """A speculating request's logprobs are those decoding gives; a stop token inside an accepted
    proposal ends it there."""
    _, plain = run(SamplingParams(max_tokens=24, logprobs=3))
    stop = plain[0].token_ids[9]
    sampling = SamplingParams(max_tokens=24, logprobs=3, stop_token_ids=[stop])
    _, plain = run(sampling)
    reference = {tuple(o.prompt_token_ids): o.token_ids for o in plain}
    _, spec = run(sampling, "ngram", scripted=lambda llm: ScriptedProposer(reference, 256))
    for a, b in zip(spec, plain):
        assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
        assert [[i for i, _ in t.top] for t in a.logprobs] == [[i for i, _ in t.top] for t in b.logprobs]
        np.testing.assert_allclose([[t.logprob, *(v for _, v in t.top)] for t in a.logprobs],
                                   [[t.logprob, *(v for _, v in t.top)] for t in b.logprobs], atol=1e-4)
    assert spec[0].finish_reason == "stop" and spec[0].token_ids[-1] == stop


def test_penalised_and_constrained_requests_do_not_speculate():
    penalised = SamplingParams(max_tokens=16, repetition_penalty=1.3, frequency_penalty=0.5)
    _, plain = run(penalised)
    llm, spec = run(penalised, "ngram", scripted=lambda llm: ScriptedProposer({}, 256))
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert scheduler_of(llm).speculator.proposed == 0
    r = Request("a", [1, 2], SamplingParams(max_tokens=4, presence_penalty=0.5), 0.0)
    assert not may_speculate(r)


def test_ngram_proposer_finds_the_latest_earlier_occurrence():
    p = NgramProposer(min_n=2, max_n=3)
    r = Request("a", [1, 2, 3, 9, 1, 2, 3, 4, 5, 1, 2, 3], SamplingParams(max_tokens=8), 0.0)
    # the latest "1 2 3" before the end; the match's length is its confidence, how far back it is its source
    assert p.propose([r], [2]) == [Guess([4, 5], 3, 5)]
    r.output_token_ids.append(6)
    assert p.propose([r], [3]) == [Guess([])]  # "3 6" and "2 3 6" never occurred
    r.output_token_ids += [1, 2]
    assert p.propose([r, r], [3, 0]) == [Guess([3, 6, 1], 2, 4), Guess([])]  # "1 2" only
    p.forget("a")
    assert p._index == {}
    with pytest.raises(ValueError):
        NgramProposer(min_n=3, max_n=2)


def measured(policy, batch, cost, lengths=None):
    """Rounds at every mean length (and run ahead, key -1) at `batch`, each first one a spike
    (the round that compiled), then its cost."""
    for k in lengths if lengths is not None else range(policy.max_k + 1):
        for seconds in (5.0, cost(batch, k)):
            policy.after_round(batch, float(k), seconds)


def guesses(n, length=6, confidence=3, source=1):
    return [Guess(list(range(length)), confidence, source) for _ in range(n)]


def test_adaptive_length_proposes_what_pays_at_the_batch_cost():
    """Rounds whose cost is flat in k (memory-bound) at high acceptance: every guess whole;
    rounds whose cost grows with every proposed token: none at a large batch, some at a small
    one. A round's first measurement at a length (a compile) does not count. The acceptance is
    per token tried, as `expected_tokens` assumes."""
    flat = AdaptiveLength(max_k=6)
    ids = [str(i) for i in range(8)]
    assert flat.choose(ids, guesses(8)) == [0] * 8  # nothing measured yet: a plain round first,
    measured(flat, 8, lambda b, k: 0.010, lengths=[0])
    assert flat.choose(ids, guesses(8)) == [1] * 8  # then one token each, to measure
    measured(flat, 8, lambda b, k: 0.010 + 1e-5 * k)
    for _ in range(10):
        for i in ids:
            flat.observe(i, 6, 5, confidence=3)  # 5 kept of 6: 5 of 6 rows' tokens, one rejected
    assert flat.acceptance("0", Guess([1], 3, 1)) == pytest.approx((50 * 0.95 + 4 * 0.5) / 60, rel=0.05)
    assert flat.choose(ids, guesses(8)) == [6] * 8
    steep = AdaptiveLength(max_k=6)
    for batch in (1, 64):
        measured(steep, batch, lambda b, k: 0.010 + 0.0005 * b * (1 + k))
    for _ in range(10):
        steep.observe("a", 4, 2, confidence=3)
    ks = steep.choose([str(i) for i in range(64)], guesses(64))
    assert set(ks) <= {0, 1} and sum(ks) <= 64 // steep.probe_every  # at most the bounded probes
    assert steep.choose(["a"], guesses(1)) != [0]
    assert expected_tokens(0.0, 5) == 1.0 and expected_tokens(1.0, 5) == 6.0


def test_a_verify_round_costs_its_token_bucket():
    """Given the engine's token buckets, a round's cost follows the bucket its rows pad to: at
    4 rows, 3 tokens each fill 16 and a fourth token pays for 32, so the policy stops at 3."""
    policy = AdaptiveLength(max_k=4, buckets=(1, 2, 4, 8, 16, 32))
    assert [policy.curve.size(4, t) for t in (0, 1, 4, 5, 12, 13, 16, 99)] == [0, 8, 8, 16, 16, 32, 32, 32]
    bucket_seconds = {0: 0.010, 8: 0.012, 16: 0.013, 32: 0.030}
    for total in (0, 4, 12, 16):
        for seconds in (5.0, bucket_seconds[policy.curve.size(4, total)]):
            policy.after_round(4, total / 4, seconds)
    ids = list("0123")
    for _ in range(10):
        for i in ids:
            policy.observe(i, 4, 4, confidence=3)
    policy.allowance = 0.0
    assert policy.choose(ids, guesses(4, length=4)) == [3] * 4


def test_lengths_the_cost_curve_cannot_tell_apart_propose_the_longest():
    """Where longer proposals cost the same as the best one within `flat` (the curve's noise)
    and make as much within `flat`, the longest of them goes: more tokens kept for the same
    time. A longer one at a dearer cost does not, even when its goodput is within `flat`."""
    def lengths(flat, acceptance, cost):
        policy = AdaptiveLength(max_k=4, flat=flat, prior_acceptance=acceptance)
        measured(policy, 1, lambda b, k: cost[k])
        assert policy.acceptance("a", Guess([1], 3, 1)) == pytest.approx(acceptance)  # nothing seen: the prior
        return policy.choose(["a"], guesses(1, length=4))

    flat_cost = {0: 1.0, 1: 1.0, 2: 1.01, 3: 1.015, 4: 1.5}  # at acceptance 0.05: k=1 best, 2 and 3 within 1.2%
    assert lengths(0.0, 0.05, flat_cost) == [1] and lengths(0.02, 0.05, flat_cost) == [3]
    dearer = {0: 1.0, 1: 1.0, 2: 1.04, 3: 1.5, 4: 2.0}  # at 0.19: k=2 makes 3% more for 4% more time
    assert lengths(0.02, 0.19, dearer) == [1]


def test_a_length_measured_slow_once_is_measured_again():
    """A verify size whose first rounds ran slow (the machine's hiccup) is not locked out: once
    stale it is measured again when the allowance pays, and the fresh reading replaces it."""
    def cost(k):
        return 0.010 * (1 + 0.02 * k)

    policy = AdaptiveLength(max_k=4)
    measured(policy, 1, lambda b, k: 3 * cost(k) if k == 4 else cost(k))
    chosen = []
    for _ in range(400):
        policy.observe("a", 4, 4, confidence=3)
        k, = policy.choose(["a"], guesses(1, length=4))
        policy.after_round(1, float(k), cost(k))
        chosen.append(k)
    assert chosen[0] == 3 and chosen[-100:].count(4) >= 90, chosen  # the others: stale shorter sizes measured again
    assert policy.cost(1, 4) == pytest.approx(cost(4), rel=0.05)


def test_requests_in_one_round_propose_by_their_own_acceptance():
    """Per request: one whose guesses were kept proposes more than one whose guesses were
    rejected, in the same round; a request without a guess proposes nothing."""
    policy = AdaptiveLength(max_k=4)
    measured(policy, 4, lambda b, k: 0.010 * (1 + 0.15 * k))
    for _ in range(20):
        policy.observe("good", 4, 4, confidence=2)
        policy.observe("bad", 4, 0, confidence=2)
    ks = policy.choose(["good", "bad", "none", "new"], [Guess([1] * 4, 2, 7), Guess([1] * 4, 2, 7), Guess([]),
                                                        Guess([1] * 4, 2, 7)])
    assert ks[0] == 4 and ks[1] < ks[0] and ks[2] == 0, ks


def test_no_guess_is_not_a_rejection_and_nothing_locks_out():
    """A request the proposer has nothing for counts nothing (the old engine-wide rate counted
    it as a rejection and turned speculation off for good); a request whose guesses were all
    rejected proposes one token again when its guess comes from a new place, at most once every
    `probe_every` rounds."""
    from cbjax.request import RequestState
    from cbjax.scheduling.speculation import Speculator

    class Sometimes:
        def __init__(self):
            self.source = 1

        def propose(self, requests, ks):
            return [Guess([7, 8, 9][:k], 2, self.source) if r.request_id == "copy" else Guess([])
                    for r, k in zip(requests, ks)]

        def forget(self, request_id):
            pass

        def warmup(self):
            return 0

    lengths = AdaptiveLength(max_k=3, probe_every=4)
    spec = Speculator(Sometimes(), lengths, max_seq_len=64)
    requests = [Request(rid, [1, 2, 3], SamplingParams(max_tokens=60), 0.0) for rid in ("copy", "chat")]
    for r in requests:
        r.state = RequestState.RUNNING
    for _ in range(30):  # nothing to copy for a while: no trials at all
        spec.proposals(requests[1:], 3)
    assert lengths.accept.requests == {} and lengths.accept.by_confidence == {}
    measured(lengths, 2, lambda b, k: 0.010 * (1 + 0.3 * k))
    for _ in range(30):  # every guess rejected
        if spec.proposals(requests, 3)[0]:
            spec.record(requests[0], 3, 0)
        lengths.after_round(2, 0.0, 0.01)
    assert spec.proposals(requests, 3)[0] == []  # it stopped proposing
    spec.proposer.source = 2  # a new match
    tried = []
    for _ in range(8):
        tried.append(len(spec.proposals(requests, 3)[0]))
        lengths.after_round(2, 0.0, 0.01)
    assert tried[0] == 1 and sum(tried) == 1, tried  # one probe token, not one every round
    # A probe that turns a plain round into a verify round (30% dearer here) waits until
    # `explore_share` of the rounds' time has paid for it (stale sizes measured again, which
    # the same allowance pays for, are tested apart).
    lengths.allowance, lengths.curve.stale_after = 0.0, 10**6
    spec.proposer.source = 3
    tried, wait = [], 0.003 / (lengths.explore_share * 0.01)
    for _ in range(round(wait) + 8):
        tried.append(len(spec.proposals(requests, 3)[0]))
        lengths.after_round(2, 0.0, 0.01)
    assert sum(tried) == 1 and abs(tried.index(1) - wait) <= 1, tried
    spec.record(requests[0], 1, 1)
    assert lengths.accept.requests["copy"].accepted > 0
    spec.forget("copy")
    assert "copy" not in lengths.accept.requests


def test_a_costly_proposer_runs_only_as_far_as_the_planned_length():
    """A proposer whose guesses cost steps (a draft model) is asked for lengths planned before it
    runs: none, then one token each, while the cost curve is unmeasured, then one length for all (its
    cost follows the longest proposal), as long as pays: all of `max_k` at a flat cost and
    high acceptance, none at a steep cost and low acceptance."""
    from cbjax.request import RequestState
    from cbjax.scheduling.speculation import Speculator

    class Costly:
        costly = True

        def __init__(self):
            self.asked = []

        def propose(self, requests, ks):
            self.asked.append(list(ks))
            return [Guess([5] * k, 9) for k in ks]

        def forget(self, request_id):
            pass

        def warmup(self):
            return 0

    requests = [Request(str(i), [1, 2, 3], SamplingParams(max_tokens=60), 0.0) for i in range(4)]
    for r in requests:
        r.state = RequestState.RUNNING
    for cost, kept, want in ((lambda b, k: 0.010 + 1e-5 * k, 4, [4] * 4), (lambda b, k: 0.010 * (1 + k), 0, [0] * 4)):
        draft, lengths = Costly(), AdaptiveLength(max_k=4)
        spec = Speculator(draft, lengths, max_seq_len=64)
        assert [len(p) for p in spec.proposals(requests, 4)] == draft.asked[-1] == [0] * 4  # a plain round,
        measured(lengths, 4, cost, lengths=[0])
        assert [len(p) for p in spec.proposals(requests, 4)] == draft.asked[-1] == [1] * 4  # then one token
        for r in requests:
            spec.record(r, 1, min(kept, 1))
        assert all(lengths.accept.requests[r.request_id].confidence == 9 for r in requests)
        measured(lengths, 4, cost)
        for _ in range(10):
            for r in requests:
                lengths.observe(r.request_id, 4, kept, confidence=9)
        lengths.allowance = 0.0  # nothing saved for exploring yet
        assert [len(p) for p in spec.proposals(requests, 4)] == draft.asked[-1] == want
    # No lock-out: a round planned at 0 tries one token for every row once the allowance
    # (`explore_share` of the rounds' time) pays what it adds (a plain round's cost here).
    tried = []
    for _ in range(round(1 / lengths.explore_share) + 20):
        tried.append(max(len(p) for p in spec.proposals(requests, 4)))
        lengths.after_round(4, float(tried[-1]), cost(4, tried[-1]))
    assert set(tried) == {0, 1} and sum(tried) == 1, tried


def test_speculation_knobs_are_checked():
    from cbjax import EngineArgs

    with pytest.raises(ValueError, match="speculative_method"):
        EngineArgs(speculative_method="eagle")
    with pytest.raises(ValueError, match="speculative_length"):
        EngineArgs(speculative_method="ngram", speculative_length="sometimes")
    with pytest.raises(ValueError, match="pipeline"):
        EngineArgs(speculative_method="ngram", pipeline_stages=2)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        EngineArgs(speculative_method="ngram", num_speculative_tokens=0)


def test_preemption_and_prefix_cache_under_speculation():
    """A paged cache too small for every request (recompute preemptions) with prefix caching:
    follow-up prompts (prompt + answer + more) hit pages registered from accepted tokens only,
    and every output equals plain decoding's."""
    kw = dict(kv_cache="paged", page_size=8, num_pages=18, enable_prefix_caching=True, merge_mode="chunked")
    greedy = SamplingParams(max_tokens=28)
    outs = {}
    for method in ("none", "ngram"):
        llm, first = run(greedy, method, **kw)
        follow = [o.prompt_token_ids + o.token_ids + [5, 6, 7] for o in first]
        second = llm.generate(follow, greedy, use_tqdm=False)
        outs[method] = ([o.token_ids for o in first], [o.token_ids for o in second])
        load = llm.load()
        if method == "ngram":
            assert load.spec_draft_tokens > 0 and load.prefix_hits > 0
            assert load.num_preemptions > 0
    assert outs["ngram"] == outs["none"]


def test_speculation_counts_reach_the_metrics_endpoint():
    from cbjax.serve.prometheus import ServerMetrics

    llm, _ = run(SamplingParams(max_tokens=24), "ngram")
    load = llm.load()
    text = ServerMetrics("tiny").render(load).decode()
    assert load.spec_draft_tokens >= load.spec_accepted_tokens > 0
    assert f'vllm:spec_decode_num_draft_tokens{{model_name="tiny"}} {float(load.spec_draft_tokens)}' in text
    rate = load.spec_accepted_tokens / load.spec_draft_tokens
    assert f'cbjax:spec_decode_acceptance_rate{{model_name="tiny"}} {rate}' in text


def test_warm_up_compiles_the_verify_programs():
    from cbjax.runtime.traced.device_state import TRACE_COUNTS

    llm = LLM(MODEL, max_seq_len=96, num_slots=4, speculative_method="ngram", num_speculative_tokens=3,
              speculative_length="fixed")
    llm.warmup()
    assert any(kind == "verify" for kind, _, _ in engine_of(llm).programs())
    traced = sum(TRACE_COUNTS.values())
    llm.generate(prompts(2), SamplingParams(max_tokens=20), use_tqdm=False)
    assert llm.load().spec_draft_tokens > 0
    assert sum(TRACE_COUNTS.values()) == traced, "a speculating workload compiled after warm-up"


FAMILIES = ["tiny-llama", "tiny-mistral", "tiny-qwen2", "tiny-qwen3", "tiny-gpt2"]


@pytest.mark.parametrize("family", sweep(FAMILIES, quick={"tiny-llama"}))
def test_every_family_speculates_token_exact(family):
    """Both cache layouts (paged with chunked prefill, slots with fused steps): n-gram and
    scripted proposals, and on the slot cache a draft that is the target itself (every
    proposal accepted), greedy: plain decoding's tokens."""
    greedy = SamplingParams(max_tokens=20)
    for layout in (dict(kv_cache="paged", page_size=8, merge_mode="chunked"), dict(merge_mode="fused")):
        kw = dict(model=family, **layout)
        _, plain = run(greedy, **kw)
        expected = [o.token_ids for o in plain]
        reference = {tuple(o.prompt_token_ids): o.token_ids for o in plain}
        _, ngram = run(greedy, "ngram", **kw)
        assert [o.token_ids for o in ngram] == expected, layout
        llm, scripted = run(greedy, "ngram", scripted=lambda llm: ScriptedProposer(reference, 500), **kw)
        assert [o.token_ids for o in scripted] == expected, layout
        assert scheduler_of(llm).speculator.proposed > scheduler_of(llm).speculator.accepted > 0
    llm, itself = run(greedy, "draft", speculative_model=family, **kw)
    assert [o.token_ids for o in itself] == expected
    spec = scheduler_of(llm).speculator
    assert spec.accepted == spec.proposed > 0


@pytest.mark.parametrize("merge_mode", sweep(["prefill_first", "fused", "chunked"], quick={"chunked"}))
def test_a_second_model_drafts_for_the_target(merge_mode):
    """A different tiny model of the same vocabulary as the draft: some proposals accepted, some
    not; greedy and seeded sampling give plain decoding's tokens, in every merge mode."""
    for sampling in (SamplingParams(max_tokens=24), SamplingParams(max_tokens=24, temperature=0.8, seed=3)):
        _, plain = run(sampling, merge_mode=merge_mode)
        llm, drafted = run(sampling, "draft", speculative_model="tiny-mistral", merge_mode=merge_mode)
        assert [o.token_ids for o in drafted] == [o.token_ids for o in plain]
        assert scheduler_of(llm).speculator.proposed > 0


def test_a_draft_with_another_vocabulary_is_refused():
    with pytest.raises(ValueError, match="speculative_model.*vocabulary"):
        LLM(MODEL, max_seq_len=64, speculative_method="draft", speculative_model="tiny-qwen2")
    from cbjax import EngineArgs

    with pytest.raises(ValueError, match="speculative_model"):
        EngineArgs(speculative_method="draft")
    with pytest.raises(ValueError, match="speculative_model"):
        EngineArgs(speculative_model="tiny-llama")


@pytest.mark.parametrize("case", ["slots-swap", "paged-swap-prefix", "paged-recompute"])
def test_priority_preemption_of_speculating_requests(case):
    """Later arrivals outrank running, speculating requests: they are swapped out (or recomputed)
    and come back token-exact; after the drain no slot, page or swapped sequence is held."""
    from tests.test_host_tier import assert_drained, run as staggered, workload

    options = dict(ordering="priority", num_slots=4, max_seq_len=64)
    if "paged" in case:
        options.update(kv_cache="paged", page_size=8, num_pages=12, enable_prefix_caching="prefix" in case,
                       merge_mode="chunked", max_num_batched_tokens=24)
    if "swap" in case:
        options.update(preemption_mode="swap", host_kv_cache_bytes=1 << 24)
    prompts, max_tokens, priorities = workload(512)
    expected, _ = staggered(LLM(MODEL, **options), prompts, max_tokens, priorities)
    llm = LLM(MODEL, speculative_method="ngram", num_speculative_tokens=3, speculative_length="fixed", **options)
    scheduler_of(llm).speculator.proposer = ScriptedProposer(
        {tuple(p): e for p, e in zip(prompts, expected)}, 512)
    outputs, _ = staggered(llm, prompts, max_tokens, priorities)
    assert outputs == expected
    assert llm.load().spec_accepted_tokens > 0 and llm.load().num_preemptions > 0
    if "swap" in case:
        assert scheduler_of(llm).host.stats.swaps_out > 0
    assert_drained(llm)


def test_sampled_tokens_keep_the_targets_distribution_on_a_tiny_vocabulary(monkeypatch):
    """A 12-token vocabulary at temperature 1.5, 400 seeds: with the same seeds, speculation's
    tokens are decoding's, position by position (so their frequencies are equal); and against
    decoding with other seeds, a two-sample chi-square test at every position finds nothing.
    Its verify calls sample at the flat tokens (16 rows proposing few tokens) and at each row's
    positions (with prompt rows), and both are exact."""
    import dataclasses

    from cbjax.runtime.traced import speculative

    modes, at_flat_tokens = [], speculative.at_flat_tokens
    monkeypatch.setattr(speculative, "at_flat_tokens", lambda b, p: modes.append(at_flat_tokens(b, p)) or modes[-1])

    from jax.scipy.stats import chi2

    from cbjax.loading.model import Model
    from cbjax.loading.presets import RANDOM_PRESETS
    from cbjax.models.params import init_params

    config = dataclasses.replace(RANDOM_PRESETS[MODEL], vocab_size=12, eos_token_ids=(11,))
    model = Model(config, init_params(config, seed=4), None, source="tiny-vocabulary")
    prompt = [3, 4, 5, 3, 4, 5, 3, 4]

    def frequencies(method, seeds):
        llm = LLM(model, max_seq_len=32, num_slots=16, speculative_method=method, num_speculative_tokens=3,
                  speculative_length="fixed", speculative_ngram_min=1)
        outs = llm.generate([prompt] * len(seeds), [SamplingParams(max_tokens=6, temperature=1.5, seed=s,
                                                                   ignore_eos=True) for s in seeds], use_tqdm=False)
        if method != "none":
            assert llm.load().spec_accepted_tokens > 0
        return np.array([o.token_ids for o in outs])

    seeds = list(range(400))
    plain, spec = frequencies("none", seeds), frequencies("ngram", seeds)
    assert (plain == spec).all()
    assert set(modes) == {True, False}
    other = frequencies("none", [1000 + s for s in seeds])
    for position in range(6):
        counts = np.array([np.bincount(spec[:, position], minlength=12), np.bincount(other[:, position], minlength=12)])
        counts = counts[:, counts.sum(axis=0) > 0]
        expected = counts.sum(axis=1, keepdims=True) * counts.sum(axis=0, keepdims=True) / counts.sum()
        statistic = float(((counts - expected) ** 2 / expected).sum())
        assert float(chi2.sf(statistic, counts.shape[1] - 1)) > 1e-3, (position, statistic)


def test_speculation_is_simulated_with_the_same_verification_and_charged_drafts():
    """On the simulator: every proposal accepted (acceptance 1) needs a fraction of the rounds;
    a draft's steps are charged, so it finishes later than n-gram proposals of the same
    acceptance; a draft of another vocabulary is refused."""
    prompts = [[5] * 64 for _ in range(4)]
    sampling = SamplingParams(max_tokens=40, ignore_eos=True)
    results = {}
    for label, kw in [("none", {}), ("ngram", dict(speculative_method="ngram")),
                      ("draft", dict(speculative_method="draft", speculative_model="llama3.2-1b"))]:
        llm = LLM("llama3-8b", simulate="h100", dtype="bfloat16", num_slots=4, max_seq_len=256,
                  num_speculative_tokens=4, speculative_length="fixed", simulated_acceptance=1.0, **kw)
        outs = llm.generate(prompts, sampling, use_tqdm=False)
        assert all(len(o.token_ids) == 40 for o in outs)
        results[label] = (max(o.metrics.finish_time for o in outs), llm.stats.decode_steps)
    assert results["ngram"][1] <= results["none"][1] / 4
    assert results["none"][0] > results["draft"][0] > results["ngram"][0]
    with pytest.raises(ValueError, match="speculative_model.*vocabulary"):
        LLM("llama3-8b", simulate="h100", speculative_method="draft", speculative_model="llama2-13b")


def test_aborting_a_speculating_request_frees_it_and_its_proposal_index():
    """An abort mid-generation (speculation on): the request ends, its slot is free, and the
    n-gram proposer drops what it kept for it (it raised AttributeError before the scheduler
    owned the speculator)."""
    llm = LLM("tiny-llama", num_slots=2, max_seq_len=64, speculative_method="ngram")
    rid = llm.add_request([1, 2, 3, 1, 2, 3], SamplingParams(max_tokens=20, ignore_eos=True))
    llm.step()
    llm.step()
    proposer = scheduler_of(llm).speculator.proposer
    assert rid in proposer._index  # it has proposed for the request
    assert llm.abort(rid).finish_reason == "abort"
    assert rid not in proposer._index and not llm.has_unfinished_requests()
    assert llm.snapshot().slots == (None, None)

"""Orderings by score and predicted length, aging, and priority preemption."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from cbjax import LLM, SamplingParams
from cbjax.request import Request, RequestState
from cbjax.scheduling import SchedulerConfig, ordering
from tests.hf_models import make_hf_model, save_hf_model
from tests.test_scheduler_properties import TICK, Spec, run
from tests.internals import pages_of, scheduler_of

MAX_SEQ_LEN = 64


# ------------------------------------------------------------------ aging
SHORT = dict(prompt_len=4, max_tokens=3, priority=0)
LONG = dict(prompt_len=4, max_tokens=40, priority=5)
STREAM = 3000  # short requests, two per round: more than two slots can serve


def _stream_with_one_long(long_at: float) -> list[Spec]:
    shorts = [Spec(arrival=(i // 2) * TICK, eos_at=None, **SHORT) for i in range(STREAM)]
    return shorts + [Spec(arrival=long_at, eos_at=None, **LONG)]


@pytest.mark.parametrize("merge_mode", ["prefill_first", "chunked"])
def test_aging_bounds_a_long_low_priority_requests_wait_and_without_it_the_stream_starves_it(merge_mode):
    """A constant stream of short high-priority requests keeps both slots busy. Under
    `ordering="score"` the long low-priority request (arrived at t0) outranks every short one
    that arrives after t* = t0 + (score_priority x priority gap + score_short x (1/3 - 1/40))
    / score_wait, so it finishes before the shorts that arrived up to t* have produced all
    their tokens plus its own 40 (each round produces at least one token). With score_wait 0
    it waits until the stream has ended."""
    t0 = 20 * TICK
    weights = dict(score_wait=200.0, score_short=0.5, score_priority=1.0)
    mixed = dict(merge_mode="chunked", max_num_batched_tokens=16) if merge_mode == "chunked" else {}
    config = SchedulerConfig(num_slots=2, ordering="score", **weights, **mixed)
    workload = _stream_with_one_long(t0)
    gap = (weights["score_priority"] * (LONG["priority"] - SHORT["priority"])
           + weights["score_short"] * (1 / SHORT["max_tokens"] - 1 / LONG["max_tokens"]))
    t_star = t0 + gap / weights["score_wait"]
    ahead = sum(1 for s in workload[:-1] if s.arrival <= t_star)
    # Rounds: every token of the shorts ahead of it and its own; prompt rounds that sample no
    # token are at most one per request with the chunked budget (4-token prompts fit in one).
    bound = t_star + TICK * ((SHORT["max_tokens"] + 1) * ahead + LONG["max_tokens"] + 2)
    stream_end = workload[-2].arrival
    assert bound < stream_end / 2, "the derived bound should sit well inside the stream"

    _, requests, _, _ = run(config, workload)
    long = requests[-1]
    assert len(long.output_token_ids) == LONG["max_tokens"]
    assert long.metrics.finish_time <= bound, (long.metrics.finish_time, bound)

    no_aging = dataclasses.replace(config, score_wait=0.0)
    _, requests, _, _ = run(no_aging, workload)
    assert requests[-1].metrics.scheduled_time > stream_end, "without aging the stream starves it"
    assert len(requests[-1].output_token_ids) == LONG["max_tokens"]


def test_score_and_sjf_keys_order_as_the_score_does():
    """The queue's fixed key orders requests exactly as note 004's score at any `now`."""
    config = SchedulerConfig(ordering="score", score_wait=3.0, score_short=40.0, score_priority=2.0)
    rng = np.random.default_rng(0)
    requests = [Request(str(i), [1], SamplingParams(max_tokens=int(rng.integers(1, 200))),
                        float(rng.uniform(0, 5)), priority=int(rng.integers(-2, 3)), seq_index=i)
                for i in range(60)]
    for r in requests[::3]:
        r.predicted_len = int(rng.integers(1, 50))
    key = ordering.key_function(config)
    for now in (5.0, 17.5, 1000.0):
        by_key = sorted(requests, key=key)
        scores = [ordering.score(config, r, now) for r in by_key]
        assert all(a >= b - 1e-9 for a, b in zip(scores, scores[1:]))
    sjf = sorted(requests, key=ordering.key_function(SchedulerConfig(ordering="sjf")))
    remaining = [r.predicted_remaining for r in sjf]
    assert remaining == sorted(remaining)


@pytest.mark.parametrize("bad", [dict(score_wait=float("nan")), dict(score_short=-1.0), dict(score_priority="2"),
                                 dict(ordering="longest"), dict(priority_preemption=1)])
def test_bad_ordering_knobs_are_refused_by_name(bad):
    name = next(iter(bad))
    with pytest.raises(ValueError, match=name):
        SchedulerConfig(**bad)
    with pytest.raises(ValueError, match=name):
        LLM("tiny-llama", **bad)


# ----------------------------------------------------- priority preemption
@pytest.fixture(scope="module")
def hf_and_dir(tmp_path_factory):
    hf = make_hf_model("llama", seed=4, eos_token_id=2, bos_token_id=1)
    return hf, save_hf_model(hf, str(tmp_path_factory.mktemp("llama")))


def _hf_greedy(hf, prompt, max_tokens):
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                          max_new_tokens=min(max_tokens, MAX_SEQ_LEN - len(prompt)), do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


LAYOUTS = {
    "slots": {},
    "paged": dict(kv_cache="paged", page_size=8),
    "chunked-paged": dict(merge_mode="chunked", max_num_batched_tokens=12, kv_cache="paged", page_size=8),
}


@pytest.mark.parametrize("ordering_name", ["priority", "score"])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_high_priority_request_takes_a_full_engines_slot_within_one_round(hf_and_dir, layout, ordering_name):
    hf, path = hf_and_dir
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, 160, size=int(n)).tolist() for n in (9, 14, 6)]
    max_tokens = [30, 30, 8]
    llm = LLM(path, num_slots=2, max_seq_len=MAX_SEQ_LEN, ordering=ordering_name, **LAYOUTS[layout])
    low = [llm.add_request(p, SamplingParams(max_tokens=m, ignore_eos=True), priority=5)
           for p, m in zip(prompts[:2], max_tokens[:2])]
    outputs = {}
    while not all(llm.requests[i].state == RequestState.RUNNING and len(llm.requests[i].output_token_ids) >= 3
                  for i in low):
        outputs.update((o.request_id, o) for o in llm.step() if o.finished)
    high = llm.add_request(prompts[2], SamplingParams(max_tokens=max_tokens[2], ignore_eos=True), priority=0)
    # Overlap: a decode dispatched before the arrival is recorded by a step that schedules nothing.
    if llm.core.in_flight:
        llm.step()
    llm.step()
    assert llm.requests[high].slot is not None, "the high-priority request starts in the first scheduling round"
    assert scheduler_of(llm).num_preemptions == 1
    victim = llm.requests[low[1]]  # equal priority: the later arrival goes
    assert victim.state == RequestState.WAITING and victim.metrics.num_preemptions == 1
    outputs.update((o.request_id, o) for o in llm.run_until_done())
    for rid, p, m in zip(low + [high], prompts, max_tokens):
        assert outputs[rid].token_ids == _hf_greedy(hf, p, m)[:m]
    assert scheduler_of(llm).free_slots == [0, 1]
    if pages_of(llm) is not None:
        assert pages_of(llm).num_free == pages_of(llm).num_pages and not pages_of(llm).tables

    # The knob turns it off: the newcomer waits for a slot to free.
    calm = LLM(path, num_slots=2, max_seq_len=MAX_SEQ_LEN, ordering=ordering_name, priority_preemption=False,
               **LAYOUTS[layout])
    for p, m in zip(prompts[:2], max_tokens[:2]):
        calm.add_request(p, SamplingParams(max_tokens=m, ignore_eos=True), priority=5)
    for _ in range(6):
        calm.step()
    late = calm.add_request(prompts[2], SamplingParams(max_tokens=8, ignore_eos=True), priority=0)
    calm.step()
    assert calm.requests[late].slot is None and scheduler_of(calm).num_preemptions == 0


def test_in_the_simulator_shortest_first_orderings_cut_mean_latency_and_a_predictor_steers_sjf():
    """A bimodal batch (4- and 200-token outputs, interleaved) on 4 simulated H100 slots:
    shortest-first orderings finish the short half first, so mean end-to-end latency drops
    well below FCFS's. A predictor overrides max_tokens: one that predicts the reverse of the
    truth makes sjf run the long half first, worse than FCFS."""
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, 500, size=16).tolist() for _ in range(40)]
    lengths = [4 if i % 2 else 200 for i in range(40)]
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in lengths]

    def mean_e2e(predict=None, **options):
        llm = LLM("tiny-llama", num_slots=4, max_seq_len=256, simulate="h100", **options)
        llm.core.predict_len = predict
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert [len(o.token_ids) for o in outs] == lengths
        return float(np.mean([o.metrics.e2e_latency for o in outs]))

    fcfs = mean_e2e()
    assert mean_e2e(ordering="sjf") < 0.7 * fcfs
    assert mean_e2e(ordering="score", score_wait=0.0, score_short=10.0) < 0.7 * fcfs
    reverse = {tuple(p): 204 - n for p, n in zip(prompts, lengths)}
    assert mean_e2e(ordering="sjf", predict=lambda ids: reverse[tuple(ids)]) > 1.1 * fcfs

"""The front door: online API, streaming, abort, bad input, sampling, compilation counts, replay."""

from __future__ import annotations

import numpy as np
import pytest

from cbjax import LLM, EngineArgs, SamplingParams
from cbjax.loading import Model
from cbjax.loading.presets import RANDOM_PRESETS
from cbjax.simulator import SimClock, SimulatedEngine
from cbjax.runtime.engine import TRACE_COUNTS
from tests.tiers import slow
from tests.internals import engine_of, pages_of, scheduler_of

MAX_SEQ_LEN = 128


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny-llama", num_slots=4, max_seq_len=MAX_SEQ_LEN, seed=0)


def random_prompt(rng, n, vocab=512):
    return rng.integers(3, vocab, size=n).tolist()


@slow
def test_no_recompilation_after_warmup_over_200_random_requests():
    llm = LLM("tiny-llama", num_slots=8, max_seq_len=MAX_SEQ_LEN, refill_interval=2)
    num_programs = engine_of(llm).warmup()
    # One step per token bucket: 8, 16, ... up to the step budget (512 on a CPU; the suite's
    # smallest bucket is 8, conftest.py).
    assert num_programs == len(engine_of(llm).programs()) == 7
    compiled = sum(TRACE_COUNTS.values())
    rng = np.random.default_rng(0)
    prompts = [random_prompt(rng, int(n)) for n in rng.integers(1, 100, size=200)]
    params = [SamplingParams(max_tokens=int(m), temperature=float(t), top_k=int(k), top_p=float(p))
              for m, t, k, p in zip(rng.integers(1, 28, size=200), rng.choice([0.0, 0.7, 1.3], size=200),
                                    rng.choice([0, 5], size=200), rng.choice([1.0, 0.8], size=200))]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert all(o.finish_reason in ("stop", "length") for o in outputs)
    assert sum(TRACE_COUNTS.values()) == compiled, "a steady workload recompiled after warm-up"


def test_chunked_prefill_programs_are_bounded_and_warmed():
    llm = LLM("tiny-llama", num_slots=4, max_seq_len=64, max_prefill_tokens=24)
    llm.warmup()
    compiled = sum(TRACE_COUNTS.values())
    rng = np.random.default_rng(1)
    prompts = [random_prompt(rng, int(n)) for n in rng.integers(1, 60, size=40)]
    llm.generate(prompts, SamplingParams(max_tokens=4), use_tqdm=False)
    assert sum(TRACE_COUNTS.values()) == compiled


@pytest.mark.parametrize("options", [dict(num_slots=8, max_seq_len=512),
                                     dict(num_slots=8, max_seq_len=2048, max_prefill_tokens=256, kv_cache="paged",
                                          enable_prefix_caching=True),
                                     dict(num_slots=8, max_seq_len=2048, merge_mode="chunked", kv_cache="paged",
                                          enable_prefix_caching=True),
                                     dict(num_slots=64, max_seq_len=4096, kv_cache="paged")])
def test_the_programs_do_not_grow_with_max_seq_len(options):
    """The engine's model programs are its token buckets: at most 16, and as many at 8192
    tokens as at 512, 2048 or 4096 (SmolLM2's shapes of the one-step issue; counted, not compiled)."""
    smollm2 = Model(RANDOM_PRESETS["smollm2-135m-random"], params=None, tokenizer=None, source="shape")
    counts = []
    for max_seq_len in (options["max_seq_len"], 8192):
        config = EngineArgs(**{**options, "max_seq_len": max_seq_len}).engine_config()
        counts.append(len(SimulatedEngine(smollm2, config, cost=None, clock=SimClock()).programs()))
    assert counts[0] == counts[1] <= 16


def test_streaming_step_outputs_add_up(llm):
    rng = np.random.default_rng(2)
    ids = [llm.add_request(random_prompt(rng, 5 + i), SamplingParams(max_tokens=6 + i)) for i in range(6)]
    streamed = {i: [] for i in ids}
    finished = {}
    while llm.has_unfinished_requests():
        for out in llm.step():
            streamed[out.request_id] += out.new_token_ids
            if out.finished:
                assert out.request_id not in finished
                finished[out.request_id] = out
    assert set(finished) == set(ids)
    for rid in ids:
        assert streamed[rid] == finished[rid].token_ids


def test_abort_waiting_and_running_requests_leaves_others_unharmed(llm):
    rng = np.random.default_rng(3)
    prompts = [random_prompt(rng, 8) for _ in range(6)]
    alone = LLM(llm.model, num_slots=4, max_seq_len=MAX_SEQ_LEN).generate(
        prompts, SamplingParams(max_tokens=12, ignore_eos=True), use_tqdm=False)
    ids = [llm.add_request(p, SamplingParams(max_tokens=12, ignore_eos=True)) for p in prompts]
    llm.step()
    llm.step()
    running = next(r for r in scheduler_of(llm).running)
    out = llm.abort(running.request_id)
    assert out.finish_reason == "abort"
    waiting = scheduler_of(llm).waiting[0].request_id
    assert llm.abort(waiting).finish_reason == "abort"
    with pytest.raises(ValueError, match="unknown or finished"):
        llm.abort("no-such-request")
    with pytest.raises(ValueError, match="unknown or finished"):
        llm.abort(waiting)
    finished = {o.request_id: o for o in llm.run_until_done()}
    assert set(finished) == set(ids) - {running.request_id, waiting}
    for i, rid in enumerate(ids):
        if rid in finished:
            assert finished[rid].token_ids == alone[i].token_ids


@pytest.mark.parametrize("prompt,params,match", [
    ([], None, "empty prompt"),
    ([1, 2, 9999], None, "outside the vocabulary"),
    ([1, -1], None, "outside the vocabulary"),
    (list(range(3, 3 + MAX_SEQ_LEN)), None, "leaves no room"),
    ("hello", None, "no tokenizer"),
    ([1.5, 2], None, "token id"),
    ([1, 2], "greedy", "SamplingParams"),
])
def test_bad_requests_are_rejected_clearly(llm, prompt, params, match):
    with pytest.raises(ValueError, match=match):
        llm.add_request(prompt, params)
    assert not llm.has_unfinished_requests()


@pytest.mark.parametrize("kwargs,match", [
    (dict(max_tokens=0), "max_tokens"),
    (dict(temperature=-0.1), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-1), "top_k"),
    (dict(seed=-3), "seed"),
    (dict(stop_token_ids=[-4]), "stop_token_ids"),
])
def test_nonsense_sampling_values_are_rejected(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_duplicate_request_id_is_rejected(llm):
    llm.add_request([5, 6, 7], SamplingParams(max_tokens=2), request_id="dup")
    with pytest.raises(ValueError, match="duplicate request id"):
        llm.add_request([5, 6, 7], SamplingParams(max_tokens=2), request_id="dup")
    llm.run_until_done()


def test_generate_gives_bad_prompts_an_error_and_runs_the_rest(llm):
    rng = np.random.default_rng(4)
    good = [random_prompt(rng, 6), random_prompt(rng, 9)]
    outputs = llm.generate([good[0], [], good[1], [1, 100000]], SamplingParams(max_tokens=5), use_tqdm=False)
    assert [o.finish_reason for o in outputs] == ["length", "error", "length", "error"]
    assert "empty prompt" in outputs[1].error and "vocabulary" in outputs[3].error
    reference = llm.generate(good, SamplingParams(max_tokens=5), use_tqdm=False)
    assert outputs[0].token_ids == reference[0].token_ids and outputs[2].token_ids == reference[1].token_ids


def test_stop_tokens_and_ignore_eos(llm):
    rng = np.random.default_rng(5)
    prompt = random_prompt(rng, 10)
    (free,) = llm.generate([prompt], SamplingParams(max_tokens=20, ignore_eos=True), use_tqdm=False)
    stop_at = free.token_ids[5]
    (stopped,) = llm.generate([prompt], SamplingParams(max_tokens=20, ignore_eos=True, stop_token_ids=[stop_at]),
                              use_tqdm=False)
    cut = free.token_ids.index(stop_at) + 1
    assert stopped.token_ids == free.token_ids[:cut] and stopped.finish_reason == "stop"


def test_seeded_sampling_is_reproducible_across_batches_and_slots(llm):
    rng = np.random.default_rng(6)
    prompts = [random_prompt(rng, int(n)) for n in rng.integers(3, 30, size=7)]
    sp = SamplingParams(max_tokens=10, temperature=1.0, top_k=50, top_p=0.9, seed=1234, ignore_eos=True)
    a = llm.generate(prompts, sp, use_tqdm=False)
    b = llm.generate(prompts[::-1], sp, use_tqdm=False)[::-1]
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    other = llm.generate(prompts, SamplingParams(**{**sp.__dict__, "seed": 99}), use_tqdm=False)
    assert [o.token_ids for o in a] != [o.token_ids for o in other]


def test_top_k_one_and_tiny_top_p_are_greedy(llm):
    rng = np.random.default_rng(7)
    prompts = [random_prompt(rng, 12) for _ in range(3)]
    greedy = llm.generate(prompts, SamplingParams(max_tokens=8), use_tqdm=False)
    k1 = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=2.0, top_k=1, seed=3), use_tqdm=False)
    p0 = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=2.0, top_p=1e-6, seed=3), use_tqdm=False)
    assert [o.token_ids for o in greedy] == [o.token_ids for o in k1] == [o.token_ids for o in p0]


def test_metrics_timestamps_are_ordered(llm):
    rng = np.random.default_rng(8)
    outs = llm.generate([random_prompt(rng, 5) for _ in range(5)], SamplingParams(max_tokens=4), use_tqdm=False)
    for o in outs:
        m = o.metrics
        assert m.arrival_time <= m.scheduled_time <= m.first_token_time <= m.finish_time
        assert m.token_times == sorted(m.token_times) and len(m.token_times) == len(o.token_ids)


def test_replay_admits_at_arrival_times(llm):
    rng = np.random.default_rng(9)
    workload = [(0.02 * i, random_prompt(rng, 6), SamplingParams(max_tokens=3)) for i in range(5)]
    outs = llm.replay(workload, use_tqdm=False)
    arrivals = [o.metrics.arrival_time for o in outs]
    assert np.allclose(np.diff(arrivals), 0.02, atol=1e-6)
    assert all(o.metrics.scheduled_time >= o.metrics.arrival_time for o in outs)
    assert all(o.finish_reason == "length" for o in outs)


def test_seeded_sampling_survives_preemption():
    """A preempted request recomputes its tokens and samples on from the same output index,
    so its seeded tokens equal those of a run that was never preempted."""
    rng = np.random.default_rng(10)
    prompts = [random_prompt(rng, int(n)) for n in rng.integers(5, 30, size=6)]
    sp = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, seed=77, ignore_eos=True)
    calm = LLM("tiny-llama", num_slots=3, max_seq_len=64).generate(prompts, sp, use_tqdm=False)
    tight = LLM("tiny-llama", num_slots=3, max_seq_len=64, kv_cache="paged", page_size=8, num_pages=10)
    stormy = tight.generate(prompts, sp, use_tqdm=False)
    assert scheduler_of(tight).num_preemptions > 0
    assert [o.token_ids for o in stormy] == [o.token_ids for o in calm]
    assert any(o.metrics.num_preemptions for o in stormy)


def test_request_that_could_never_fit_the_pages_is_rejected():
    llm = LLM("tiny-llama", num_slots=2, max_seq_len=64, kv_cache="paged", page_size=8, num_pages=3)
    with pytest.raises(ValueError, match="could never fit"):
        llm.add_request(list(range(3, 23)), SamplingParams(max_tokens=10))
    llm.add_request(list(range(3, 13)), SamplingParams(max_tokens=10))  # 20 tokens: 3 pages fit
    llm.run_until_done()


def test_kv_cache_bytes_sizes_both_layouts():
    from cbjax.models.kv_cache import PagedCache, SlotCache
    from cbjax.loading.presets import RANDOM_PRESETS

    cfg = RANDOM_PRESETS["tiny-llama"]
    budget = 3 * SlotCache.bytes_per_slot(cfg, 64) + 5
    slots = LLM("tiny-llama", max_seq_len=64, kv_cache_bytes=budget)
    assert engine_of(slots).num_slots == 3
    paged = LLM("tiny-llama", max_seq_len=64, kv_cache="paged", page_size=8, kv_cache_bytes=budget, num_slots=16)
    assert pages_of(paged).num_pages == budget // PagedCache.bytes_per_page(cfg, 8) == 24
    with pytest.raises(ValueError, match="holds no"):
        LLM("tiny-llama", max_seq_len=64, kv_cache_bytes=10)


@pytest.mark.parametrize("layout", [dict(), dict(kv_cache="paged", page_size=8, num_pages=40)])
def test_overlap_runs_decode_ahead_without_changing_outputs(layout):
    """With overlap on, decode calls are dispatched before the previous one is recorded;
    requests that finish mid-way (short budgets, an abort while a call runs ahead, a late
    arrival) get exactly the tokens of the run without overlap, and nothing stays held."""
    rng = np.random.default_rng(11)
    prompts = [random_prompt(rng, int(n)) for n in rng.integers(3, 30, size=6)]
    budgets = [3, 25, 9, 40, 1, 17]
    results = {}
    for overlap in (False, True):
        llm = LLM("tiny-llama", num_slots=4, max_seq_len=MAX_SEQ_LEN, overlap=overlap, **layout)
        ids = [llm.add_request(p, SamplingParams(max_tokens=m, ignore_eos=True))
               for p, m in zip(prompts[:4], budgets[:4])]
        finished = {}
        for _ in range(6):
            finished.update((o.request_id, o) for o in llm.step() if o.finished)
        aborted = llm.abort(ids[3])  # running, with a decode call in flight when overlapping
        assert aborted.finish_reason == "abort"
        ids += [llm.add_request(p, SamplingParams(max_tokens=m, ignore_eos=True))
                for p, m in zip(prompts[4:], budgets[4:])]
        finished.update((o.request_id, o) for o in llm.run_until_done())
        results[overlap] = [finished[i].token_ids for i in ids if i != ids[3]]
        assert [len(t) for t in results[overlap]] == [3, 25, 9, 1, 17]
        assert (llm.stats.ahead_calls > 0) == overlap
        assert scheduler_of(llm).free_slots == list(range(4)) and not llm.requests
        if pages_of(llm) is not None:
            assert pages_of(llm).num_free == pages_of(llm).num_pages and not pages_of(llm).tables
    assert results[True] == results[False]


def test_a_server_front_with_arrivals_pending_keeps_no_decode_call_queued_ahead():
    """A front whose requests arrive at any time (`arrivals_pending`, the server's queue):
    the next decode call is dispatched only once the one in flight is done and nothing has
    arrived, so an arrival waits for one call, not two. Tokens equal those without overlap."""
    tokens = {}
    for overlap in (False, True):
        llm = LLM("tiny-llama", num_slots=4, max_seq_len=MAX_SEQ_LEN, overlap=overlap)
        pending = [False]
        llm.core.arrivals_pending = lambda: pending[0]
        first = llm.add_request([5, 6, 7], SamplingParams(max_tokens=30, ignore_eos=True))
        outputs = [o for _ in range(3) for o in llm.step()]
        assert llm.core.in_flight == overlap  # nothing arrived: a call runs ahead of the host
        pending[0] = True  # a request is on its way in
        outputs += llm.step()
        assert not llm.core.in_flight  # the call in flight was recorded and none queued behind it
        pending[0] = False
        late = llm.add_request([8, 9, 10, 11], SamplingParams(max_tokens=5, ignore_eos=True))
        step = llm.step()
        assert late in {o.request_id for o in step}
        outputs += step + llm.run_until_done()
        tokens[overlap] = {i: [o for o in outputs if o.request_id == i and o.finished][0].token_ids
                           for i in (first, late)}
        assert (llm.stats.ahead_calls > 0) == overlap
    assert tokens[True] == tokens[False]


@pytest.mark.parametrize("overlap", [False, True])
def test_a_request_admitted_in_a_round_gets_its_first_token_in_that_round(overlap):
    """vLLM's scenario: admit, step once, the first token is out, also while a decode call
    runs ahead of the host (overlap), whose round then admits and prefills the newcomer."""
    llm = LLM("tiny-llama", num_slots=4, max_seq_len=MAX_SEQ_LEN, overlap=overlap)
    llm.add_request([5, 6, 7], SamplingParams(max_tokens=40, ignore_eos=True))
    for _ in range(3):
        llm.step()
    assert llm.core.in_flight == overlap  # a decode call dispatched ahead, not yet recorded
    late = llm.add_request([8, 9, 10, 11], SamplingParams(max_tokens=5, ignore_eos=True))
    outputs = {o.request_id: o for o in llm.step()}
    # its first token (and, prefill_first, the same round's decode token) is out now
    assert late in outputs and len(outputs[late].new_token_ids) >= 1
    llm.run_until_done()


def test_token_buckets_stop_at_what_one_round_can_hold():
    """A round holds at most a row per slot, none longer than max_seq_len: a bucket past
    num_slots * max_seq_len would be a program warm-up compiles and no call runs."""
    small = LLM("tiny-llama", num_slots=2, max_seq_len=32, min_step_tokens=1)
    assert engine_of(small).token_buckets() == [1, 2, 4, 8, 16, 32, 64]
    assert engine_of(LLM("tiny-llama", num_slots=3, max_seq_len=32)).token_buckets()[-1] == 128  # holds 96
    assert engine_of(LLM("tiny-llama", num_slots=8, max_seq_len=128)).token_buckets()[-1] == 512  # the CPU's budget


@pytest.mark.parametrize("overlap", [False, True])
def test_reset_stats_starts_every_counter_over(overlap):
    """After `reset_stats` the rounds that follow are counted in full: the dispatch and the
    host copy's wait too, and (overlap) the calls run ahead."""
    llm = LLM("tiny-llama", num_slots=4, max_seq_len=MAX_SEQ_LEN, overlap=overlap)
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
    llm.reset_stats()
    assert llm.stats.rounds == 0 and llm.stats.dispatch_s == 0
    llm.generate([[5, 6, 7], [8, 9]], SamplingParams(max_tokens=12, ignore_eos=True), use_tqdm=False)
    stats = llm.stats
    assert stats.rounds > 0 and stats.decode_steps > 0 and stats.active_slot_steps > stats.decode_steps
    assert stats.dispatch_s > 0 and stats.device_wait_s > 0
    assert (stats.ahead_calls > 0) == overlap

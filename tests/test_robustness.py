"""The outside audit's findings, one test each (issue 8): every one failed on the code it
was found in. Bad input is refused where it enters and never harms another request."""

from __future__ import annotations

import gc
import weakref

import jax.numpy as jnp
import numpy as np
import pytest

from cbjax import LLM, SamplingParams
from cbjax.scheduling.block_manager import BlockManager
from cbjax.runtime.engine import Engine
from tests.tiers import sweep
from tests.internals import engine_of, pages_of, scheduler_of

MAX_SEQ_LEN = 64


@pytest.fixture(scope="module")
def model():
    from cbjax.loading import load_model

    return load_model("tiny-llama")


def prompts_of(rng, lengths, vocab=500):
    return [rng.integers(3, vocab, size=int(n)).tolist() for n in lengths]


# 1 ---------------------------------------------------------------------------------------
def test_requests_finishing_on_their_first_token_are_returned(model):
    """max_tokens=1 and a stop id sampled first: step() returns them finished, and the
    offline loop counts them (the progress bar used to stop short)."""
    rng = np.random.default_rng(1)
    prompts = prompts_of(rng, (5, 9, 7))
    llm = LLM(model, num_slots=4, max_seq_len=MAX_SEQ_LEN)
    first = [o.token_ids[0] for o in llm.generate(prompts, SamplingParams(max_tokens=3), use_tqdm=False)]
    ids = [llm.add_request(prompts[0], SamplingParams(max_tokens=1)),
           llm.add_request(prompts[1], SamplingParams(max_tokens=8, stop_token_ids=[first[1]])),
           llm.add_request(prompts[2], SamplingParams(max_tokens=4))]
    finished = {}
    for _ in range(20):
        finished.update((o.request_id, o) for o in llm.step() if o.finished)
    assert set(finished) == set(ids)
    assert finished[ids[0]].token_ids == [first[0]] and finished[ids[0]].finish_reason == "length"
    assert finished[ids[1]].token_ids == [first[1]] and finished[ids[1]].finish_reason == "stop"
    for p in prompts:
        llm.add_request(p, SamplingParams(max_tokens=1))
    assert len(llm.run_until_done()) == 3


# 2 ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs,match", [
    (dict(max_tokens=2 ** 31), "max_tokens"),
    (dict(top_k=2 ** 31), "top_k"),
    (dict(stop_token_ids=[2 ** 31]), "stop_token_ids"),
    (dict(seed=2 ** 31), "seed"),
    (dict(temperature=1e39), "temperature"),
    (dict(max_tokens=4.0), "max_tokens"),
    (dict(ignore_eos="no"), "ignore_eos"),
])
def test_values_that_overflow_the_device_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_numpy_scalars_are_accepted_as_plain_values():
    sp = SamplingParams(max_tokens=np.int64(5), temperature=np.float32(0.5), stop_token_ids=np.array([3, 4]))
    assert sp.max_tokens == 5 and type(sp.max_tokens) is int and sp.stop_token_ids == (3, 4)


BAD_REQUESTS = [
    (dict(prompt=b"hello"), "prompt"),
    (dict(prompt=bytearray(b"\x05\x06")), "prompt"),
    (dict(prompt=[np.float32(3.0), np.float32(4.5)]), "token id"),
    (dict(prompt=[3, True]), "token id"),
    (dict(prompt=7), "prompt"),
    (dict(priority="high"), "priority"),
    (dict(priority=float("nan")), "priority"),
    (dict(arrival_time="soon"), "arrival_time"),
    (dict(arrival_time=float("inf")), "arrival_time"),
    (dict(sampling=SamplingParams(stop_token_ids=[2 ** 31 - 1])), "stop_token_ids outside the vocabulary"),
    (dict(sampling={"max_tokens": 3}), "SamplingParams"),
    (dict(request_id=["x"]), "request_id"),
]


@pytest.mark.parametrize("bad,match", BAD_REQUESTS)
@pytest.mark.parametrize("kv_cache", ["slots", "paged"])
def test_one_bad_request_never_harms_the_others_online(model, bad, match, kv_cache):
    rng = np.random.default_rng(2)
    good = prompts_of(rng, (6, 11))
    sp = SamplingParams(max_tokens=6, ignore_eos=True)
    expected = LLM(model, num_slots=2, max_seq_len=MAX_SEQ_LEN).generate(good, sp, use_tqdm=False)
    llm = LLM(model, num_slots=2, max_seq_len=MAX_SEQ_LEN, kv_cache=kv_cache, page_size=8, ordering="priority")
    first = llm.add_request(good[0], sp)
    llm.step()
    args = dict(prompt=[5, 6, 7], sampling=SamplingParams(max_tokens=4)) | bad
    with pytest.raises(ValueError, match=match):
        llm.add_request(args.pop("prompt"), args.pop("sampling"), **args)
    second = llm.add_request(good[1], sp)
    outs = {}
    while llm.has_unfinished_requests():
        outs.update((o.request_id, o) for o in llm.step() if o.finished)
    assert [outs[first].token_ids, outs[second].token_ids] == [o.token_ids for o in expected]


def test_one_bad_request_never_harms_the_others_offline(model):
    rng = np.random.default_rng(3)
    good = prompts_of(rng, (6, 11))
    sp = SamplingParams(max_tokens=5)
    llm = LLM(model, num_slots=2, max_seq_len=MAX_SEQ_LEN)
    expected = llm.generate(good, sp, use_tqdm=False)
    mixed = [good[0], b"bytes", [np.float32(1.5)], good[1], [2 ** 40]]
    outs = llm.generate(mixed, [sp, sp, sp, sp, sp], use_tqdm=False)
    assert [o.finish_reason for o in outs] == ["length", "error", "error", "length", "error"]
    assert [outs[0].token_ids, outs[3].token_ids] == [o.token_ids for o in expected]
    outs = llm.generate(good + good[:1], [sp, "greedy", sp], use_tqdm=False)
    assert outs[1].finish_reason == "error" and "SamplingParams" in outs[1].error
    assert [outs[0].token_ids, outs[2].token_ids] == [expected[0].token_ids, expected[0].token_ids]


@pytest.mark.parametrize("kwargs,match", [
    (dict(num_slots=2.5), "num_slots"),
    (dict(num_slots="4"), "num_slots"),
    (dict(kv_cache="paged", page_size=0, kv_cache_bytes=10 ** 6), "page_size"),
    (dict(kv_cache_bytes=-5), "kv_cache_bytes"),
    (dict(max_seq_len=64.0), "max_seq_len"),
    (dict(decode_steps=0), "decode_steps"),
    (dict(window_ms=float("nan")), "window_ms"),
    (dict(max_prefill_tokens=0), "max_prefill_tokens"),
])
def test_bad_engine_options_are_refused_before_the_model_loads(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LLM("no-such-model-so-loading-would-fail-differently", **kwargs)


# 3 ---------------------------------------------------------------------------------------
def test_auto_ids_never_collide_with_user_ids(model):
    llm = LLM(model, num_slots=2, max_seq_len=MAX_SEQ_LEN)
    llm.add_request([5, 6], SamplingParams(max_tokens=2), request_id="0")
    llm.add_request([5, 6], SamplingParams(max_tokens=2), request_id=1)
    auto = [llm.add_request([7, 8], SamplingParams(max_tokens=2)) for _ in range(3)]
    assert len(set(auto) | {"0", "1"}) == 5
    assert len(llm.run_until_done()) == 5


# 4 ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("page_size,num_pages,decode_steps,prompt_len,max_tokens", [
    (4, 3, 8, 5, 7),  # the request fills the pool exactly; a decode call looks 8 steps ahead
    (4, 3, 4, 5, 7),
    (8, 2, 16, 3, 13),
    (4, 4, 3, 9, 8),
])
def test_paged_decode_lookahead_never_livelocks(model, page_size, num_pages, decode_steps, prompt_len, max_tokens):
    rng = np.random.default_rng(4)
    prompts = prompts_of(rng, (prompt_len, prompt_len))
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    expected = LLM(model, num_slots=2, max_seq_len=MAX_SEQ_LEN).generate(prompts, sp, use_tqdm=False)
    llm = LLM(model, num_slots=2, max_seq_len=MAX_SEQ_LEN, kv_cache="paged", page_size=page_size,
              num_pages=num_pages, decode_steps=decode_steps)
    ids = [llm.add_request(p, sp) for p in prompts]
    outs = {}
    for _ in range(200):  # a livelock never finishes; each request needs far fewer rounds
        outs.update((o.request_id, o) for o in llm.step() if o.finished)
        if not llm.has_unfinished_requests():
            break
    assert set(outs) == set(ids), "a request that fits the pool never finished"
    assert [outs[i].token_ids for i in ids] == [o.token_ids for o in expected]
    assert pages_of(llm).num_free == num_pages


# 5 ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("kv_cache", sweep(["slots", "paged"], quick={"slots"}))
def test_bfloat16_serves_batched_prefills_end_to_end(kv_cache):
    rng = np.random.default_rng(5)
    prompts = prompts_of(rng, rng.integers(3, 40, size=6))
    sp = SamplingParams(max_tokens=10, ignore_eos=True)
    options = dict(max_seq_len=MAX_SEQ_LEN, dtype="bfloat16", kv_cache=kv_cache, page_size=8)
    batched = LLM("tiny-llama", num_slots=6, **options)
    assert all(a.dtype == jnp.bfloat16 for a in engine_of(batched).cache.k)
    together = batched.generate(prompts, sp, use_tqdm=False)  # prefills of 2+ prompts in one call
    alone = LLM("tiny-llama", num_slots=1, **options).generate(prompts, sp, use_tqdm=False)
    assert all(o.finish_reason == "length" and len(o.token_ids) == 10 for o in together)
    assert [o.token_ids for o in together] == [o.token_ids for o in alone]
    f32 = LLM("tiny-llama", num_slots=6, max_seq_len=MAX_SEQ_LEN).generate(prompts, sp, use_tqdm=False)
    assert sum(a.token_ids[0] == b.token_ids[0] for a, b in zip(together, f32)) >= 5


# 6 ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("options", sweep([
    dict(kv_cache="paged", page_size=8, num_pages=14, enable_prefix_caching=True, decode_steps=2),
    dict(max_prefill_tokens=12),
    dict(kv_cache="paged", page_size=8, num_pages=20, enable_prefix_caching=True, max_prefill_tokens=16),
], quick=[dict(max_prefill_tokens=12)]))
def test_warmup_covers_every_program_the_configuration_reaches(model, options):
    llm = LLM(model, num_slots=4, max_seq_len=MAX_SEQ_LEN, **options)
    llm.warmup()
    compiled = Engine.num_backend_compilations()
    rng = np.random.default_rng(6)
    system = prompts_of(rng, (20,))[0]
    prompts = [(system if i % 2 else []) + p for i, p in enumerate(prompts_of(rng, rng.integers(1, 36, size=60)))]
    params = [SamplingParams(max_tokens=int(m), temperature=float(t), seed=i)
              for i, (m, t) in enumerate(zip(rng.integers(1, 20, size=60), rng.choice([0.0, 0.8], size=60)))]
    ids = [llm.add_request(p, s) for p, s in zip(prompts[:6], params)]
    llm.step()
    llm.abort(next(r.request_id for r in scheduler_of(llm).running))
    llm.abort(ids[-1]) if ids[-1] in llm.requests else None
    llm.run_until_done()
    llm.generate(prompts, params, use_tqdm=False)
    assert Engine.num_backend_compilations() == compiled, "compiled after warm-up"


# 7 ---------------------------------------------------------------------------------------
def test_finished_requests_are_released_once_returned(model):
    llm = LLM(model, num_slots=2, max_seq_len=MAX_SEQ_LEN, kv_cache="paged", page_size=8)
    rng = np.random.default_rng(7)
    outs = llm.generate(prompts_of(rng, (4, 5, 6)), SamplingParams(max_tokens=3), use_tqdm=False)
    assert len(outs) == 3 and not llm.requests and not llm.book._emitted
    rid = llm.add_request([5, 6, 7], SamplingParams(max_tokens=3))
    request = weakref.ref(llm.requests[rid])
    aborted = llm.add_request([5, 6, 7], SamplingParams(max_tokens=30))
    llm.step()
    assert llm.abort(aborted).finish_reason == "abort" and aborted not in llm.requests
    done = []
    while llm.has_unfinished_requests():
        done += [o for o in llm.step() if o.finished]
    assert [o.request_id for o in done] == [rid] and not llm.requests
    gc.collect()
    assert request() is None, "nothing holds a finished request after it was returned"
    # Requests added online and finished while generate() drove the loop come back from step().
    online = llm.add_request([8, 9], SamplingParams(max_tokens=2))
    llm.generate([[3, 4]], SamplingParams(max_tokens=2), use_tqdm=False)
    assert [o.request_id for o in llm.step() if o.finished] == [online] and not llm.requests


# 8 ---------------------------------------------------------------------------------------
def test_seeded_sampling_draws_per_token_id_not_per_rank():
    """Logits with exact ties, then a 1e-6 perturbation that reorders the tied tokens: the
    distribution is the same to float32 precision, so the same seed must pick the same token."""
    from cbjax.runtime.traced.sampling import sample

    rng = np.random.default_rng(8)
    rows = 256  # one row per seed, all in one call
    base = np.repeat(np.round(rng.normal(size=(1, 64)), 1).astype(np.float32), rows, axis=0)
    nudged = base + (rng.normal(size=base.shape) * 1e-6).astype(np.float32)
    assert (np.argsort(-base, axis=1, kind="stable") != np.argsort(-nudged, axis=1, kind="stable")).any(axis=1).all()
    ones, zeros = jnp.ones(rows), jnp.zeros(rows, jnp.int32)
    seeds = jnp.arange(rows, dtype=jnp.int32)
    a, b = (sample(jnp.asarray(x), ones, zeros, ones, zeros.astype(jnp.float32), seeds, zeros) for x in (base, nudged))
    assert len(set(np.asarray(a).tolist())) > 10, "the draws really are random"
    assert np.array_equal(np.asarray(a), np.asarray(b))


# 9 ---------------------------------------------------------------------------------------
def test_prefix_cache_evicts_plain_pages_first_then_lru_tail_first():
    bm = BlockManager(num_pages=8, page_size=4, enable_prefix_caching=True)
    a = list(range(10, 23))  # 13 tokens: 3 full pages + 1 partial
    bm.allocate("a", a)
    bm.register("a", a, len(a))
    a_pages = list(bm.table("a"))
    bm.free("a")
    # The partial page holds no cached prefix: it goes before any cached page.
    bm.allocate("b", list(range(100, 116)))  # 4 pages: the 4 never-used ones
    bm.allocate("c", [200, 201])
    assert bm.table("c") == [a_pages[3]]
    # Then cached pages, a sequence's last page first, so the shared head survives longest.
    bm.allocate("d", [300])
    assert bm.table("d") == [a_pages[2]]
    bm.free("c")
    bm.free("d")
    assert bm.allocate("e", a) == 8 and bm.table("e")[:2] == a_pages[:2]


def test_prefix_cache_least_recently_freed_goes_first():
    bm = BlockManager(num_pages=4, page_size=2, enable_prefix_caching=True)
    for name, tokens in (("old", [1, 2, 3, 4]), ("new", [5, 6, 7, 8])):
        bm.allocate(name, tokens)
        bm.register(name, tokens, len(tokens))
    old_pages = list(bm.table("old"))
    bm.free("old")
    bm.free("new")
    bm.allocate("x", [9, 9, 9, 9])
    assert sorted(bm.table("x")) == sorted(old_pages)
    assert bm.allocate("y", [5, 6, 7]) == 2  # the recent prefix's head is still cached


def test_pages_filled_during_decode_serve_a_follow_up(model):
    rng = np.random.default_rng(9)
    prompt = prompts_of(rng, (20,))[0]
    sp = SamplingParams(max_tokens=20, ignore_eos=True)
    llm = LLM(model, num_slots=2, max_seq_len=MAX_SEQ_LEN, kv_cache="paged", page_size=8,
              enable_prefix_caching=True)
    (first,) = llm.generate([prompt], sp, use_tqdm=False)
    follow_up = prompt + first.token_ids + prompts_of(rng, (5,))[0]
    hits = pages_of(llm).stats.hits
    (second,) = llm.generate([follow_up], sp, use_tqdm=False)
    # 39 tokens were computed (prompt + answer but its last token): 4 full pages, 2 from decode.
    assert pages_of(llm).stats.hits - hits == 4
    (reference,) = LLM(model, num_slots=1, max_seq_len=MAX_SEQ_LEN).generate([follow_up], sp, use_tqdm=False)
    assert second.token_ids == reference.token_ids

"""Logprobs, logits processors (penalties, min_tokens, logit_bias) and parallel sampling
(n, best_of), against transformers and against single seeded runs."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
import transformers

from cbjax import LLM, SamplingParams
from cbjax.runtime.traced.device_state import FREQUENCY, PRESENCE, REPETITION, SlotState
from cbjax.runtime.traced.sampling import process_logits
from tests.hf_models import make_hf_model, save_hf_model
from tests.internals import pages_of, scheduler_of

MAX_SEQ_LEN = 64
LAYOUTS = {
    "slots": dict(),
    "paged": dict(kv_cache="paged", page_size=8),
    "chunked-paged": dict(merge_mode="chunked", max_num_batched_tokens=13, kv_cache="paged", page_size=8),
}


@pytest.fixture(scope="module")
def hf_and_dir(tmp_path_factory):
    hf = make_hf_model("llama", seed=3)
    return hf, save_hf_model(hf, str(tmp_path_factory.mktemp("llama")))


def _prompts(n=3, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 160, size=int(k)).tolist() for k in rng.integers(4, 30, size=n)]


def _last_logits(hf, ids) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0, -1].double()


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_logprobs_equal_transformers_log_softmax(hf_and_dir, layout):
    hf, path = hf_and_dir
    llm = LLM(path, max_seq_len=MAX_SEQ_LEN, num_slots=4, **LAYOUTS[layout])
    prompts = _prompts()
    outs = llm.generate(prompts, SamplingParams(max_tokens=6, logprobs=5, ignore_eos=True), use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert len(out.logprobs) == len(out.token_ids) == 6
        ids = list(prompt)
        for token, lp in zip(out.token_ids, out.logprobs):
            ref = torch.log_softmax(_last_logits(hf, ids), -1)
            assert lp.token_id == token
            assert abs(lp.logprob - ref[token].item()) < 1e-4
            top = torch.topk(ref, 5)
            assert [i for i, _ in lp.top] == top.indices.tolist()
            np.testing.assert_allclose([v for _, v in lp.top], top.values.numpy(), atol=1e-4)
            assert [v for _, v in lp.top] == sorted((v for _, v in lp.top), reverse=True)
            ids.append(token)
        assert out.cumulative_logprob == pytest.approx(sum(t.logprob for t in out.logprobs))
    plain = llm.generate(prompts, SamplingParams(max_tokens=6, ignore_eos=True), use_tqdm=False)
    assert [o.token_ids for o in plain] == [o.token_ids for o in outs]
    assert all(o.logprobs is None for o in plain)


def _rows(vocab, seen, counts, **floats):
    """Two rows of a fresh `SlotState` with the penalties' history and the float columns given."""
    rows = dataclasses.replace(SlotState.init(2, 4, 4, vocab).rows(np.arange(2)), seen=seen, counts=counts)
    columns = {"presence": PRESENCE, "frequency": FREQUENCY, "repetition": REPETITION}
    for name, value in floats.items():
        rows = dataclasses.replace(rows, floats=rows.floats.at[:, columns[name]].set(value))
    return rows


def test_penalties_equal_transformers_and_openai_formula():
    rng = np.random.default_rng(1)
    vocab = 50
    logits = rng.normal(size=(2, vocab)).astype(np.float32) * 3
    prompt = [[1, 2, 3, 3], [7, 8]]
    output = [[3, 9, 9, 9, 11], [8, 8, 20]]
    seen = np.zeros((2, vocab), bool)
    counts = np.zeros((2, vocab), np.int32)
    for r in range(2):
        seen[r, prompt[r]] = True
        np.add.at(counts[r], output[r], 1)
    # Repetition penalty alone: transformers' processor over prompt + output.
    rows = _rows(vocab, seen=seen, counts=counts, repetition=np.array([1.3, 0.7], np.float32))
    got = np.asarray(process_logits(logits, rows, np.array([5, 3])))
    for r, penalty in enumerate((1.3, 0.7)):
        processor = transformers.RepetitionPenaltyLogitsProcessor(penalty)
        ref = processor(torch.tensor([prompt[r] + output[r]]), torch.tensor(logits[r:r + 1])).numpy()[0]
        np.testing.assert_allclose(got[r], ref, rtol=1e-6)
    # Presence and frequency: OpenAI's formula over the output's counts.
    presence, frequency = np.array([0.5, -1.0], np.float32), np.array([0.25, 1.5], np.float32)
    rows = _rows(vocab, seen=seen, counts=counts, presence=presence, frequency=frequency)
    got = np.asarray(process_logits(logits, rows, np.array([5, 3])))
    ref = logits - frequency[:, None] * counts - presence[:, None] * (counts > 0)
    np.testing.assert_allclose(got, ref, rtol=1e-6)
    # Nothing on: the logits pass through untouched.
    np.testing.assert_array_equal(np.asarray(process_logits(logits, _rows(vocab, seen=seen, counts=counts),
                                                            np.array([5, 3]))), logits)


@pytest.mark.parametrize("layout", ["slots", "chunked-paged"])
def test_greedy_repetition_penalty_equals_transformers_generate(hf_and_dir, layout):
    hf, path = hf_and_dir
    llm = LLM(path, max_seq_len=MAX_SEQ_LEN, num_slots=4, **LAYOUTS[layout])
    prompts = _prompts(4, seed=2)
    plain = SamplingParams(max_tokens=12, ignore_eos=True)
    # Requests without penalties leave their tokens in every slot's history first: a penalized
    # request that takes a slot after them starts from a cleared one, and a later request
    # without penalties is not touched by what the penalized ones left.
    before = llm.generate(prompts, plain, use_tqdm=False)
    for penalty in (1.5, 0.8):
        outs = llm.generate(prompts, SamplingParams(max_tokens=12, min_tokens=12, repetition_penalty=penalty),
                            use_tqdm=False)
        for prompt, out in zip(prompts, outs):
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                              repetition_penalty=penalty, min_new_tokens=12, pad_token_id=0)[0, len(prompt):]
            assert out.token_ids == ref.tolist()
    assert [o.token_ids for o in llm.generate(prompts, plain, use_tqdm=False)] == [o.token_ids for o in before]


def _greedy_with_openai_penalties(hf, prompt, steps, presence, frequency):
    ids, counts = list(prompt), {}
    for _ in range(steps):
        logits = _last_logits(hf, ids).float().numpy()
        for t, c in counts.items():
            logits[t] -= frequency * c + presence
        token = int(np.argmax(logits))
        counts[token] = counts.get(token, 0) + 1
        ids.append(token)
    return ids[len(prompt):]


def test_presence_frequency_and_bias_in_generation(hf_and_dir):
    hf, path = hf_and_dir
    llm = LLM(path, max_seq_len=MAX_SEQ_LEN, num_slots=4, merge_mode="chunked", max_num_batched_tokens=16)
    prompts = _prompts(3, seed=4)
    out = llm.generate(prompts, SamplingParams(max_tokens=10, presence_penalty=1.5, frequency_penalty=0.7,
                                               ignore_eos=True), use_tqdm=False)
    for prompt, o in zip(prompts, out):
        assert o.token_ids == _greedy_with_openai_penalties(hf, prompt, 10, 1.5, 0.7)
    biased = llm.generate(prompts, SamplingParams(max_tokens=5, logit_bias={42: 100.0}, ignore_eos=True),
                          use_tqdm=False)
    assert all(o.token_ids == [42] * 5 for o in biased)


def test_min_p_cuts_relative_to_the_likeliest_token(hf_and_dir):
    import jax.numpy as jnp

    from cbjax.runtime.traced.sampling import sample

    rows = 256  # one seed per row
    logits = jnp.tile(jnp.array([[0.0, -1.0, -10.0, -1.2]]), (rows, 1))
    ones, zeros, seeds = jnp.ones(rows), jnp.zeros(rows, jnp.int32), jnp.arange(rows, dtype=jnp.int32)

    def drawn(min_p):
        return set(np.asarray(sample(logits, ones, zeros, ones, jnp.full(rows, min_p), seeds, zeros)).tolist())

    assert drawn(0.0) >= {0, 1, 3}  # off: token 2 (e^-10) may or may not come up in 256 draws
    assert drawn(0.35) == {0, 1}  # e^-1 = 0.37 of the top token's probability stays, e^-1.2 = 0.30 goes
    assert drawn(0.5) == {0}
    # min_p = 1 keeps only the likeliest token: sampling at temperature 1 becomes greedy.
    _, path = hf_and_dir
    llm = LLM(path, max_seq_len=MAX_SEQ_LEN, num_slots=4)
    prompts = _prompts(3, seed=5)
    greedy = llm.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
    cut = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=1.0, min_p=1.0, seed=1, ignore_eos=True),
                       use_tqdm=False)
    assert [o.token_ids for o in cut] == [o.token_ids for o in greedy]
    with pytest.raises(ValueError, match="min_p"):
        SamplingParams(min_p=1.5)


def test_min_tokens_masks_stop_tokens(hf_and_dir):
    _, path = hf_and_dir
    llm = LLM(path, max_seq_len=MAX_SEQ_LEN, num_slots=2)
    eos = llm.model.config.eos_token_ids[0]
    # EOS is made the likeliest token: without min_tokens the request stops at once.
    forced = dict(logit_bias={eos: 100.0, 77: 50.0}, stop_token_ids=[77])
    now = llm.generate([_prompts(1)[0]], SamplingParams(max_tokens=8, **forced), use_tqdm=False)[0]
    assert now.token_ids == [eos] and now.finish_reason == "stop"
    held = llm.generate([_prompts(1)[0]], SamplingParams(max_tokens=8, min_tokens=3, **forced), use_tqdm=False)[0]
    assert len(held.token_ids) == 4 and held.token_ids[-1] == eos
    assert not {eos, 77} & set(held.token_ids[:3])


@pytest.mark.parametrize("extra", [dict(kv_cache="paged", page_size=8, enable_prefix_caching=True),
                                   dict(kv_cache="paged", page_size=8, num_pages=12, decode_steps=2)])
def test_penalties_survive_prefix_hits_and_preemption(hf_and_dir, extra):
    """A prompt that starts from cached pages, or resumes after preemption, keeps its whole
    history for the penalties: outputs equal those of a plain engine."""
    _, path = hf_and_dir
    rng = np.random.default_rng(5)
    shared = rng.integers(3, 160, size=20).tolist()
    prompts = [shared + rng.integers(3, 160, size=4).tolist() for _ in range(6)]
    sampling = SamplingParams(max_tokens=24, repetition_penalty=1.4, frequency_penalty=0.5, ignore_eos=True)
    ref = LLM(path, max_seq_len=MAX_SEQ_LEN, num_slots=4).generate(prompts, sampling, use_tqdm=False)
    llm = LLM(path, max_seq_len=MAX_SEQ_LEN, num_slots=4, **extra)
    llm.generate(prompts[:1], sampling, use_tqdm=False)  # fills the prefix cache
    got = llm.generate(prompts, sampling, use_tqdm=False)
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    if "num_pages" in extra:
        assert scheduler_of(llm).num_preemptions > 0
    else:
        assert pages_of(llm).stats.hits > 0


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_n_samples_share_the_prompt_and_equal_single_seeded_runs(hf_and_dir, layout):
    _, path = hf_and_dir
    llm = LLM(path, max_seq_len=MAX_SEQ_LEN, num_slots=4, **LAYOUTS[layout])
    prompt = np.random.default_rng(6).integers(3, 160, size=27).tolist()
    sampling = SamplingParams(max_tokens=10, temperature=0.9, top_p=0.95, seed=11, n=4, ignore_eos=True)
    llm.add_request(prompt, sampling, request_id="r")
    outs, shared_counts = [], []
    while llm.has_unfinished_requests():
        outs += llm.step()
        if pages_of(llm) is not None and sum(r.state.value == "running" for r in llm.requests.values()) == 4:
            # The prompt's 3 full pages (24 of 26 shared tokens) are held once, by all four samples.
            tables = [pages_of(llm).tables[f"r/{i}"] for i in range(4)]
            assert all(t[:3] == tables[0][:3] for t in tables)
            assert [pages_of(llm).ref_counts[p] for p in tables[0][:3]] == [4, 4, 4]
            # Distinct pages held: every sample's own pages, the shared three once (not four times).
            assert len({p for t in tables for p in t}) == sum(map(len, tables)) - 3 * 3
            shared_counts.append(len(tables))
    if pages_of(llm) is not None:
        assert shared_counts  # checked during decode
        assert pages_of(llm).num_free == pages_of(llm).num_pages
    finished = sorted((o for o in outs if o.finished), key=lambda o: o.index)
    assert [o.index for o in finished] == [0, 1, 2, 3] and {o.request_id for o in finished} == {"r"}
    for o in finished:
        alone = llm.generate([prompt], SamplingParams(max_tokens=10, temperature=0.9, top_p=0.95, seed=11 + o.index,
                                                      ignore_eos=True), use_tqdm=False)[0]
        assert o.token_ids == alone.token_ids
    assert len({tuple(o.token_ids) for o in finished}) > 1
    grouped = llm.generate([prompt], sampling, use_tqdm=False)[0]
    assert [s.token_ids for s in grouped.samples] == [o.token_ids for o in finished]


def test_best_of_returns_the_likeliest_samples(hf_and_dir):
    _, path = hf_and_dir
    llm = LLM(path, max_seq_len=MAX_SEQ_LEN, num_slots=4, kv_cache="paged", page_size=8)
    prompt = _prompts(1, seed=7)[0]
    out = llm.generate([prompt], SamplingParams(max_tokens=6, temperature=1.0, seed=5, n=2, best_of=5),
                       use_tqdm=False)[0]
    every = [llm.generate([prompt], SamplingParams(max_tokens=6, temperature=1.0, seed=5 + i, logprobs=0),
                          use_tqdm=False)[0] for i in range(5)]
    best = sorted(every, key=lambda o: -o.cumulative_logprob)[:2]
    assert [s.token_ids for s in out.samples] == [o.token_ids for o in best]
    assert [s.index for s in out.samples] == [0, 1]
    assert out.samples[0].logprobs is None  # not asked for
    assert out.samples[0].cumulative_logprob == pytest.approx(best[0].cumulative_logprob, abs=1e-5)


def test_abort_one_sample_or_all(hf_and_dir):
    _, path = hf_and_dir
    llm = LLM(path, max_seq_len=MAX_SEQ_LEN, num_slots=2, kv_cache="paged", page_size=8)
    llm.add_request(_prompts(1)[0], SamplingParams(max_tokens=20, n=3, temperature=1.0, ignore_eos=True),
                    request_id="g")
    llm.step()
    one = llm.abort("g", 1)
    assert one.index == 1 and one.finish_reason == "abort"
    rest = llm.abort("g")
    assert sorted(o.index for o in rest) == [0, 2]
    assert not llm.has_request("g") and not llm.has_unfinished_requests()
    assert pages_of(llm).num_free == pages_of(llm).num_pages


@pytest.mark.parametrize("kwargs, message", [
    (dict(logprobs=21), "max_logprobs"), (dict(logit_bias={999: 1.0}), "logit_bias"),
    (dict(logit_bias={1: float("nan")}), "logit_bias"), (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(presence_penalty=3.0), "presence_penalty"), (dict(n=0), "n"), (dict(n=3, best_of=2), "best_of"),
    (dict(min_tokens=20, max_tokens=4), "min_tokens")])
def test_bad_sampling_values_are_refused(hf_and_dir, kwargs, message):
    _, path = hf_and_dir
    llm = LLM(path, max_seq_len=MAX_SEQ_LEN, num_slots=2)
    outs = llm.generate([[5, 6, 7], [8, 9]], [None, None], use_tqdm=False)
    with pytest.raises(ValueError, match=message):
        llm.add_request([5, 6, 7], SamplingParams(**kwargs))
    assert not llm.has_unfinished_requests()
    assert [o.token_ids for o in llm.generate([[5, 6, 7], [8, 9]], use_tqdm=False)] == [o.token_ids for o in outs]


def test_n_samples_through_replicas(hf_and_dir):
    from cbjax.parallel.replicas import Replicas

    _, path = hf_and_dir
    prompts = _prompts(3, seed=8)
    sampling = SamplingParams(max_tokens=5, temperature=0.8, seed=2, n=2, ignore_eos=True)
    front = Replicas(path, data_parallel=2, num_slots=2, max_seq_len=MAX_SEQ_LEN, kv_cache="paged", page_size=8)
    try:
        outs = front.generate(prompts, sampling)
        assert not front.has_unfinished_requests() and not front._owner
    finally:
        front.close()
    ref = LLM(path, max_seq_len=MAX_SEQ_LEN, num_slots=4).generate(prompts, sampling, use_tqdm=False)
    assert [[s.token_ids for s in o.samples] for o in outs] == [[s.token_ids for s in o.samples] for o in ref]


def test_sampling_without_top_k_or_top_p_skips_the_sort_and_draws_the_same_tokens():
    import jax
    import jax.numpy as jnp

    from cbjax.runtime.traced import sampling

    rng = np.random.default_rng(0)
    rows = 64
    logits = jnp.asarray(rng.normal(0, 3, (rows, 1000)).astype(np.float32))
    logits = logits.at[::7, :5].set(logits[::7, :1])  # ties at the top in some rows
    temperature = jnp.asarray(rng.choice([0.3, 1.0, 2.0], rows).astype(np.float32))
    min_p = jnp.asarray(rng.choice([0.0, 0.05, 0.5], rows).astype(np.float32))
    off = (jnp.zeros(rows, jnp.int32), jnp.ones(rows, jnp.float32))
    seeds, index = jnp.arange(rows, dtype=jnp.int32), jnp.arange(rows, dtype=jnp.int32) % 5
    args = (logits, temperature, *off, min_p, seeds, index)
    sorted_draws = jax.vmap(sampling._sample_row)(*args)
    unsorted_draws = jax.vmap(sampling._sample_row_unsorted)(*args)
    np.testing.assert_array_equal(np.asarray(sorted_draws), np.asarray(unsorted_draws))
    assert len(set(np.asarray(unsorted_draws).tolist())) > 10  # it does sample

"""Greedy outputs under every policy equal transformers' `generate`, token for token."""

from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch

from cbjax import LLM, SamplingParams
from cbjax.loading import load_hf_dir
from tests.hf_models import make_hf_model, save_hf_model
from tests.tiers import slow, sweep
from tests.internals import engine_of, pages_of, scheduler_of

MAX_SEQ_LEN = 64
NUM_PROMPTS = 20
NUM_SLOTS = 4

POLICIES = {
    "static": dict(policy="static"),
    "static-length-aware": dict(policy="static", length_aware=True, batch_size=3),
    "dynamic": dict(policy="dynamic", window_ms=0.5),
    "continuous-r1": dict(policy="continuous", refill_interval=1),
    "continuous-no-overlap": dict(policy="continuous", overlap=False),
    "continuous-r3": dict(policy="continuous", refill_interval=3),
    "continuous-r8-steps2": dict(policy="continuous", refill_interval=8, decode_steps=2),
    "continuous-tgi-ratio": dict(policy="continuous", waiting_served_ratio=1.5, max_waiting_steps=4),
    "continuous-chunked": dict(policy="continuous", max_prefill_tokens=16),
    "continuous-priority-rank-preempt": dict(policy="continuous", ordering="priority"),
    "continuous-sjf": dict(policy="continuous", ordering="sjf"),
    "paged-score-rank-preempt": dict(policy="continuous", ordering="score", kv_cache="paged", page_size=8,
                                     num_pages=20),
    "paged": dict(policy="continuous", kv_cache="paged", page_size=8),
    "paged-prefix-cache": dict(policy="continuous", kv_cache="paged", page_size=8, enable_prefix_caching=True),
    # 14 pages of 8 tokens for 4 slots of up to 64 tokens: forces preemptions.
    "paged-preempt": dict(policy="continuous", kv_cache="paged", page_size=8, num_pages=14, decode_steps=2),
    "paged-preempt-no-overlap": dict(policy="continuous", kv_cache="paged", page_size=8, num_pages=10,
                                     decode_steps=2, overlap=False),
    "paged-static": dict(policy="static", kv_cache="paged", page_size=8, num_pages=14),
    "paged-pallas": dict(policy="continuous", kv_cache="paged", page_size=8, num_pages=20, attention="pallas"),
    # The slot cache through the same kernel (a slot read as a run of pages).
    "slots-pallas": dict(policy="continuous", attention="pallas"),
    "chunked-13-slots-pallas-priority-rank-preempt": dict(policy="continuous", merge_mode="chunked",
                                                          max_num_batched_tokens=13, ordering="priority",
                                                          attention="pallas"),
    # Mixed steps. A budget of 13 tokens cuts prompts at odd offsets (13 minus the running decodes).
    "fused": dict(policy="continuous", merge_mode="fused"),
    # Four token buckets per doubling from 16 (20, 24, 28, 40, ...): whole prompts in each.
    "fused-bucket-steps-4": dict(policy="continuous", merge_mode="fused", token_bucket_steps=4),
    "fused-budget-paged": dict(policy="continuous", merge_mode="fused", max_num_batched_tokens=40,
                               kv_cache="paged", page_size=8),
    "chunked-13": dict(policy="continuous", merge_mode="chunked", max_num_batched_tokens=13),
    "chunked-13-paged-prefix-preempt": dict(policy="continuous", merge_mode="chunked", max_num_batched_tokens=13,
                                            kv_cache="paged", page_size=8, num_pages=14, enable_prefix_caching=True),
    "chunked-13-priority-rank-preempt": dict(policy="continuous", merge_mode="chunked", max_num_batched_tokens=13,
                                             ordering="priority"),
    "chunked-11-paged-pallas": dict(policy="continuous", merge_mode="chunked", max_num_batched_tokens=11,
                                    kv_cache="paged", page_size=8, num_pages=20, attention="pallas"),
    # The kernels in the third merge mode, with prefix hits and preemptions.
    "fused-paged-pallas-prefix-preempt": dict(policy="continuous", merge_mode="fused", max_num_batched_tokens=40,
                                              kv_cache="paged", page_size=8, num_pages=14,
                                              enable_prefix_caching=True, attention="pallas"),
}


def workload(vocab: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    # The last two prompts run into max_seq_len before their max_tokens.
    lengths = rng.integers(1, 44, size=NUM_PROMPTS - 2).tolist() + [55, 62]
    prompts = [rng.integers(3, vocab, size=int(n)).tolist() for n in lengths]
    max_tokens = rng.integers(1, 26, size=NUM_PROMPTS - 2).tolist() + [20, 20]
    return prompts, max_tokens


def hf_greedy(hf, prompt, max_tokens):
    budget = min(max_tokens, MAX_SEQ_LEN - len(prompt))
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                          max_new_tokens=budget, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module", params=sweep(["llama", "qwen3"], quick={"llama"}))
def setup(request, tmp_path_factory):
    return _setup(request.param, tmp_path_factory)


@pytest.fixture(scope="module")
def llama_setup(tmp_path_factory):
    return _setup("llama", tmp_path_factory)


def _setup(family, tmp_path_factory):
    hf = make_hf_model(family, seed=11, eos_token_id=2, bos_token_id=1)
    model = load_hf_dir(save_hf_model(hf, str(tmp_path_factory.mktemp(family))), with_tokenizer=False)
    assert model.config.eos_token_ids == (2,)
    prompts, max_tokens = workload(model.config.vocab_size)
    expected = [hf_greedy(hf, p, m) for p, m in zip(prompts, max_tokens)]
    return model, prompts, max_tokens, expected


def _check(outputs, prompts, max_tokens, expected):
    for i, out in enumerate(outputs):
        assert out.token_ids == expected[i], f"prompt {i} (len {len(prompts[i])}, max_tokens {max_tokens[i]})"
        if out.token_ids[-1] == 2:
            assert out.finish_reason == "stop"
        else:
            assert out.finish_reason == "length"


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_online_random_order_matches_transformers(setup, name):
    """Requests are added in random order, a few engine steps apart."""
    model, prompts, max_tokens, expected = setup
    llm = LLM(model, num_slots=NUM_SLOTS, max_seq_len=MAX_SEQ_LEN, **POLICIES[name])
    # A fixed seed per configuration: str hashes change per process, and an order that
    # never fills the pool would fail the preempting configurations' check below (+1 is
    # a seed under which all four of them preempt).
    rng = np.random.default_rng(zlib.crc32(name.encode()) + 1)
    ids, finished = {}, {}
    for i in rng.permutation(len(prompts)):
        ids[i] = llm.add_request(prompts[i], SamplingParams(max_tokens=max_tokens[i]),
                                 priority=int(rng.integers(0, 3)))
        for _ in range(int(rng.integers(0, 3))):
            finished.update((o.request_id, o) for o in llm.step() if o.finished)
    finished.update((o.request_id, o) for o in llm.run_until_done())
    outputs = [finished[ids[i]] for i in range(len(prompts))]
    _check(outputs, prompts, max_tokens, expected)
    assert not llm.has_unfinished_requests() and not llm.requests, "finished requests are released"
    assert scheduler_of(llm).free_slots == list(range(NUM_SLOTS))
    if "rank-preempt" in name:
        assert scheduler_of(llm).num_preemptions > 0
    if pages_of(llm) is not None:
        assert pages_of(llm).num_free == pages_of(llm).num_pages and not pages_of(llm).tables
        if "preempt" in name:
            assert scheduler_of(llm).num_preemptions > 0
            assert sum(o.metrics.num_preemptions for o in outputs) == scheduler_of(llm).num_preemptions


@slow
def test_the_tpu_kernel_through_the_engine_matches_transformers(llama_setup):
    """The Mosaic TPU kernel's body, under Pallas's TPU interpreter (slow: one family, one mode),
    as the engine's attention: the engine's own ragged batches (padding rows, finished decode
    rows beside chunks cut at odd offsets, preemptions) give transformers' greedy tokens."""
    import jax

    from pallas_kernels.ragged_paged_attention import set_cpu_interpreter

    model, prompts, max_tokens, expected = llama_setup
    # The last eight prompts (the two that run into max_seq_len among them) fill a pool of 10 pages.
    prompts, max_tokens, expected = prompts[-8:], max_tokens[-8:], expected[-8:]
    previous = set_cpu_interpreter("tpu")
    jax.clear_caches()  # the kernel choice is read when the step is traced
    try:
        llm = LLM(model, num_slots=NUM_SLOTS, max_seq_len=MAX_SEQ_LEN, kv_cache="paged", page_size=8, num_pages=10,
                  attention="pallas", merge_mode="chunked", max_num_batched_tokens=13)
        outputs = llm.generate(prompts, [SamplingParams(max_tokens=m) for m in max_tokens], use_tqdm=False)
    finally:
        set_cpu_interpreter(previous)
        jax.clear_caches()
    _check(outputs, prompts, max_tokens, expected)
    assert scheduler_of(llm).num_preemptions > 0


def test_offline_generate_matches_transformers(setup):
    model, prompts, max_tokens, expected = setup
    llm = LLM(model, num_slots=NUM_SLOTS, max_seq_len=MAX_SEQ_LEN)
    outputs = llm.generate(prompts, [SamplingParams(max_tokens=m) for m in max_tokens], use_tqdm=False)
    _check(outputs, prompts, max_tokens, expected)
    assert [o.prompt_token_ids for o in outputs] == prompts


def test_prefix_cache_shares_a_system_prompt_and_keeps_outputs(setup):
    """Prompts sharing a 40-token prefix: later ones reuse its pages (hits counted) and
    every output still equals transformers'."""
    model, _, _, _ = setup
    rng = np.random.default_rng(5)
    system = rng.integers(3, model.config.vocab_size, size=40).tolist()
    prompts = [system + rng.integers(3, model.config.vocab_size, size=int(n)).tolist() for n in (3, 9, 1, 14, 6)]
    params = SamplingParams(max_tokens=8)
    reference = LLM(model, num_slots=2, max_seq_len=MAX_SEQ_LEN).generate(prompts, params, use_tqdm=False)
    llm = LLM(model, num_slots=2, max_seq_len=MAX_SEQ_LEN, kv_cache="paged", page_size=8,
              enable_prefix_caching=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in reference]
    stats = pages_of(llm).stats
    # The first two run together (nothing computed yet); the other three hit the 5 shared pages.
    assert stats.hits >= 3 * 5 and 0 < stats.hit_rate <= 1


# A head_dim that is not a power of two, and sliding windows (Mistral's on every layer, Qwen2's on
# its window layers): the kernels take them, over either cache layout.
KERNEL_FAMILIES = ["llama-hd80", "qwen3-hd96", "mistral", "qwen2-window"]


@pytest.mark.parametrize("family,layout", sweep([(f, layout) for f in KERNEL_FAMILIES for layout in ("slots", "paged")],
                                               quick={("mistral", "slots"), ("llama-hd80", "paged")}))
def test_the_kernel_matches_transformers_on_any_head_dim_and_window(family, layout, tmp_path):
    """Greedy tokens with the Pallas kernel as the engine's attention (interpret mode here)
    equal transformers' for models the kernel once refused: chunks cut at odd offsets beside
    decodes, prompts and outputs well past the 12-token windows."""
    hf = make_hf_model(family, seed=11, eos_token_id=2, bos_token_id=1)
    model = load_hf_dir(save_hf_model(hf, str(tmp_path)), with_tokenizer=False)
    prompts, max_tokens = workload(model.config.vocab_size, seed=3)
    prompts, max_tokens = prompts[-8:], max_tokens[-8:]  # the last two run into max_seq_len
    expected = [hf_greedy(hf, p, m) for p, m in zip(prompts, max_tokens)]
    llm = LLM(model, num_slots=NUM_SLOTS, max_seq_len=MAX_SEQ_LEN, attention="pallas", kv_cache=layout,
              page_size=8, merge_mode="chunked", max_num_batched_tokens=13)
    assert engine_of(llm).attention == "pallas"
    outputs = llm.generate(prompts, [SamplingParams(max_tokens=m) for m in max_tokens], use_tqdm=False)
    _check(outputs, prompts, max_tokens, expected)

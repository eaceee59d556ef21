"""Prompt logprobs computed in the batched step (cbjax/prompt_scores.py): equal to the scorer
that runs its own forward over the prompt (checked against transformers in test_serve.py),
whatever the call holds (prompt chunks split over calls, decode and verify rows beside them,
a preempted request prefilled again), and a prompt scored from a position lets the prefix
cache serve the context before it."""

from __future__ import annotations

import numpy as np
import pytest

from cbjax import LLM, SamplingParams
from cbjax.prompt_scores import PromptScores

RNG = np.random.default_rng(3)
CONTEXT = RNG.integers(3, 250, 50).tolist()


def reference(llm: LLM, prompt: list[int], k: int):
    return llm.core.engine.prompt_scorer(prompt, k).run()


def assert_same(got, want, first: int = 1):
    assert len(got) == len(want)
    for position, (a, b) in enumerate(zip(got, want)):
        if position < max(first, 1):
            assert a is None, position
            continue
        assert a.token_id == b.token_id and a.rank == b.rank, position
        assert abs(a.logprob - b.logprob) < 1e-4, (position, a.logprob, b.logprob)
        assert [t for t, _ in a.top] == [t for t, _ in b.top], position
        np.testing.assert_allclose([v for _, v in a.top], [v for _, v in b.top], atol=1e-4)


@pytest.mark.parametrize("options", [
    dict(num_slots=4),
    dict(num_slots=4, kv_cache="paged", page_size=8, max_step_tokens=32),  # prompts split over calls
    dict(num_slots=2, kv_cache="paged", page_size=8, num_pages=16, merge_mode="chunked"),  # preempted, again
], ids=["slots", "paged-split", "preempted"])
def test_scores_in_the_step_equal_a_forward_of_their_own(options):
    llm = LLM("tiny-llama", max_seq_len=128, **options)
    assert llm.core.scores_prompts
    prompts = [CONTEXT + RNG.integers(3, 250, n).tolist() for n in (3, 9, 1)] + [RNG.integers(3, 250, 70).tolist()]
    asks = [SamplingParams(max_tokens=20, ignore_eos=True, prompt_logprobs=k, prompt_logprobs_from=first)
            for k, first in [(2, 0), (0, 50), (1, 7), (3, 0)]]
    plain = llm.generate(prompts, SamplingParams(max_tokens=20, ignore_eos=True), use_tqdm=False)
    outs = llm.generate(prompts, asks, use_tqdm=False)
    for prompt, sampling, out, alone in zip(prompts, asks, outs, plain):
        assert out.token_ids == alone.token_ids  # scoring changes nothing else
        assert_same(out.prompt_logprobs, reference(llm, prompt, sampling.prompt_logprobs),
                    sampling.prompt_logprobs_from)
    if "num_pages" in options:
        assert llm.core.scheduler.num_preemptions > 0


def test_scored_beside_running_and_speculating_rows():
    llm = LLM("tiny-llama", max_seq_len=128, num_slots=4, merge_mode="chunked", speculative_method="ngram",
              num_speculative_tokens=3)
    repeat = (CONTEXT[:8] * 6)[:40]
    running = [llm.add_request(repeat, SamplingParams(max_tokens=30, ignore_eos=True)) for _ in range(2)]
    for _ in range(3):
        llm.step()
    scored = llm.add_request(CONTEXT, SamplingParams(max_tokens=2, prompt_logprobs=1))
    outs = {o.request_id: o for o in llm.run_until_done()}
    assert all(outs[r].finished for r in running)
    assert_same(outs[scored].prompt_logprobs, reference(llm, CONTEXT, 1))


def test_a_context_scored_once_is_served_by_the_prefix_cache():
    """Choices of one question scored from their continuation: after the first, the context's
    pages come from the cache; a prompt scored from inside a cached context computes from there."""
    llm = LLM("tiny-llama", max_seq_len=128, num_slots=4, kv_cache="paged", page_size=8,
              enable_prefix_caching=True)
    choices = [CONTEXT + RNG.integers(3, 250, n).tolist() for n in (2, 4, 6)]
    stats = llm.core.pages.prefix.stats
    first = llm.generate(choices[:1], SamplingParams(max_tokens=1, prompt_logprobs=0, prompt_logprobs_from=50),
                         use_tqdm=False)
    assert stats.hits == 0
    rest = llm.generate(choices[1:], SamplingParams(max_tokens=1, prompt_logprobs=0, prompt_logprobs_from=50),
                        use_tqdm=False)
    assert stats.hits == 2 * (49 // 8)  # each reuses the context's whole pages before position 49
    for prompt, out in zip(choices, first + rest):
        assert_same(out.prompt_logprobs, reference(llm, prompt, 0), 50)
    inside = llm.generate([choices[0]], SamplingParams(max_tokens=1, prompt_logprobs=0, prompt_logprobs_from=20),
                          use_tqdm=False)[0]
    assert_same(inside.prompt_logprobs, reference(llm, choices[0], 0), 20)


def test_prompt_scores_record():
    scores = PromptScores([5, 6, 7, 8], k=1, first=2)
    assert scores.reusable == 1 and list(scores.targets(0, 4)) == [-1, 7, 8, -1]
    columns = np.array([[-1.0, 2, -0.5, 9, 0], [-2.0, 1, -2.0, 8, 0]], np.float32)  # k = 1 of a 2-wide step
    scores.fill(np.array([1, 2]), columns)
    assert scores.done and scores.reusable == 4 and list(scores.targets(0, 4)) == [-1] * 4
    entries = scores.entries()
    assert entries[:2] == [None, None] and entries[2].logprob == -1.0 and entries[2].rank == 2
    assert entries[3].top == ((8, -2.0),)
    with pytest.raises(RuntimeError, match="never scored"):
        PromptScores([1, 2, 3], k=0).entries()

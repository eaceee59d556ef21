"""lm-evaluation-harness's `cbjax` model (cbjax/eval) against lm-eval's own `hf` model on the
same tiny random-init checkpoint: every log-likelihood within 1e-3 and the same is-greedy,
the same rolling (perplexity) log-likelihoods, the same greedy generations cut at the same
stop strings; requests longer than the engine truncated from the left as `hf` does."""

from __future__ import annotations

import pytest
from lm_eval.api.instance import Instance
from lm_eval.models.huggingface import HFLM

from cbjax import SamplingParams
from cbjax.eval import CbjaxLM
from tests.hf_models import _CORPUS, save_chat_model

MAX_SEQ_LEN = 64


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    path = save_chat_model(str(tmp_path_factory.mktemp("eval") / "llama"))
    ours = CbjaxLM(pretrained=path, num_slots=4, max_seq_len=MAX_SEQ_LEN)
    theirs = HFLM(pretrained=path, device="cpu", dtype="float32", max_length=ours.max_length, batch_size=4)
    return ours, theirs


def instances(kind: str, arguments: list[tuple]) -> list[Instance]:
    return [Instance(request_type=kind, doc={}, arguments=a, idx=i) for i, a in enumerate(arguments)]


def test_loglikelihoods_equal_the_hf_models(models):
    ours, theirs = models
    pairs = [("The quick brown fox", " jumps over the lazy dog."),
             ("The quick brown fox", " sleeps."),  # a shared context, as a multiple-choice task has
             ("Paged attention keeps the KV cache", " in fixed-size pages."),
             ("", "Hello, world!"),  # an empty context: conditioned on the prefix token
             (" ".join(_CORPUS) * 2, " How are you today?")]  # longer than the engine: cut from the left
    assert len(ours.tok_encode(pairs[-1][0])) > ours.max_length
    got = ours.loglikelihood(instances("loglikelihood", pairs), disable_tqdm=True)
    want = theirs.loglikelihood(instances("loglikelihood", pairs), disable_tqdm=True)
    for (logprob, greedy), (hf_logprob, hf_greedy) in zip(got, want):
        assert logprob == pytest.approx(hf_logprob, abs=1e-3)
        assert greedy == hf_greedy
    # The tokens the engine generates greedily are greedy, and a changed one is not.
    context = ours.tok_encode("Continuous batching")
    tokens = ours.llm.generate([context], SamplingParams(max_tokens=4), use_tqdm=False)[0].token_ids
    changed = tokens[:2] + [(tokens[2] + 1) % len(ours.tokenizer)] + tokens[3:]
    assert [g for _, g in ours._loglikelihood_tokens([(None, context, tokens), (None, context, changed)])] == [
        True, False]


def test_rolling_loglikelihoods_equal_the_hf_models(models):
    ours, theirs = models
    docs = [(_CORPUS[0],), (" ".join(_CORPUS) * 3,)]  # the second spans several windows
    got = ours.loglikelihood_rolling(instances("loglikelihood_rolling", docs), disable_tqdm=True)
    want = theirs.loglikelihood_rolling(instances("loglikelihood_rolling", docs), disable_tqdm=True)
    assert got == pytest.approx(want, abs=1e-3 * max(len(ours.tok_encode(d[0])) for d in docs))


def test_greedy_generations_equal_the_hf_models(models):
    ours, theirs = models
    requests = [(_CORPUS[0], {"until": ["."], "max_gen_toks": 16}),
                (_CORPUS[1], {"until": ["\n\n", "e"], "max_gen_toks": 12, "do_sample": False}),
                (_CORPUS[2], {"until": [], "max_gen_toks": 8})]
    got = ours.generate_until(instances("generate_until", requests), disable_tqdm=True)
    want = theirs.generate_until(instances("generate_until", requests), disable_tqdm=True)
    assert got == want
    assert "e" not in got[1]


def test_bad_arguments_are_named(models):
    ours, _ = models
    with pytest.raises(ValueError, match="num_slotz"):
        CbjaxLM(pretrained="tiny-llama", num_slotz=4)
    with pytest.raises(ValueError, match="num_beams"):
        ours.sampling({"until": ["."], "num_beams": 4})

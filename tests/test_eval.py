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
from tests.tiers import slow, sweep

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


def test_local_tasks_agree_with_the_hf_model(models, monkeypatch):
    """The offline tasks shipped with the backend (cbjax/eval/tasks), run by lm-eval itself with
    the hub switched off: the same accuracy, log-likelihoods within 1e-3 and the same
    generations as `hf`."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import lm_eval
    from lm_eval.tasks import TaskManager

    from cbjax.eval import TASKS_DIR

    ours, theirs = models
    manager = TaskManager(include_path=TASKS_DIR)
    runs = [lm_eval.simple_evaluate(model=lm, tasks=["cbjax_cloze", "cbjax_recite"], task_manager=manager, limit=6,
                                    log_samples=True, bootstrap_iters=0) for lm in (ours, theirs)]
    assert runs[0]["results"]["cbjax_cloze"]["acc,none"] == runs[1]["results"]["cbjax_cloze"]["acc,none"]
    for task in ("cbjax_cloze", "cbjax_recite"):
        for mine, hers in zip(runs[0]["samples"][task], runs[1]["samples"][task], strict=True):
            if task == "cbjax_recite":
                assert mine["filtered_resps"] == hers["filtered_resps"]
                continue
            for (ll, greedy), (hf_ll, hf_greedy) in zip(mine["filtered_resps"], hers["filtered_resps"], strict=True):
                assert ll == pytest.approx(hf_ll, abs=1e-3) and greedy == hf_greedy


@slow
def test_the_server_path_agrees_with_the_in_process_backend(models):
    """lm-eval's `local-completions` against `cbjax.serve` (echo + logprobs for loglikelihood,
    the server's own tokenizer through /tokenize, /detokenize and /tokenizer_info): the same
    log-likelihoods, is-greedy and generations as the in-process backend."""
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    from cbjax.serve import Server

    ours, _ = models
    pairs = [("The quick brown fox", " jumps over the lazy dog."), ("The quick brown fox", " sleeps."),
             ("Paged attention keeps", " the KV cache in pages.")]
    generations = [(_CORPUS[0], {"until": ["."], "max_gen_toks": 16}), (_CORPUS[2], {"until": ["e"], "max_gen_toks": 8})]
    want = ours.loglikelihood(instances("loglikelihood", pairs), disable_tqdm=True)
    want_text = ours.generate_until(instances("generate_until", generations), disable_tqdm=True)
    with Server(ours.llm, "tiny", port=0) as server:
        api = LocalCompletionsAPI(model="tiny", base_url=server.url + "/v1/completions", tokenizer_backend="remote",
                                  tokenized_requests=True, max_length=ours.max_length, num_concurrent=2, batch_size=2,
                                  custom_prefix_token_id=ours.prefix_token_id)
        got = api.loglikelihood(instances("loglikelihood", pairs), disable_tqdm=True)
        got_text = api.generate_until(instances("generate_until", generations), disable_tqdm=True)
    for (logprob, greedy), (mine, my_greedy) in zip(got, want, strict=True):
        assert logprob == pytest.approx(mine, abs=1e-4) and greedy == my_greedy
    assert got_text == want_text


@pytest.mark.parametrize("family", sweep(["mistral", "qwen2", "qwen3", "gpt2", "mixtral", "qwen2_moe", "qwen3_moe",
                                          "olmoe"], quick={"qwen3"}))
def test_each_family_agrees_with_the_hf_model(family, tmp_path):
    """One tiny random-init checkpoint per family (llama: the module's): log-likelihoods within
    1e-3 with the same is-greedy, and the same greedy generation."""
    path = save_chat_model(str(tmp_path / family), family=family)
    ours = CbjaxLM(pretrained=path, num_slots=4, max_seq_len=MAX_SEQ_LEN)
    theirs = HFLM(pretrained=path, device="cpu", dtype="float32", max_length=ours.max_length, batch_size=4)
    pairs = [("The quick brown fox", " jumps over the lazy dog."), ("The quick brown fox", " sleeps."),
             (" ".join(_CORPUS) * 2, " How are you today?")]
    got = ours.loglikelihood(instances("loglikelihood", pairs), disable_tqdm=True)
    want = theirs.loglikelihood(instances("loglikelihood", pairs), disable_tqdm=True)
    for (logprob, greedy), (hf_logprob, hf_greedy) in zip(got, want, strict=True):
        assert logprob == pytest.approx(hf_logprob, abs=1e-3) and greedy == hf_greedy
    request = instances("generate_until", [(_CORPUS[1], {"until": ["\n\n"], "max_gen_toks": 10})])
    assert ours.generate_until(request, disable_tqdm=True) == theirs.generate_until(request, disable_tqdm=True)

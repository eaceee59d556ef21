"""A JAX training run's checkpoint (experiments/lib/flax_llama.py: flax NNX, optax, orbax)
loaded into the engine as it is (cbjax/loading/flax_checkpoint.py), in each layout the loader
reads: the engine's greedy tokens and prompt log-probabilities equal the training model's own
forward. A checkpoint with a missing, misshapen or unknown parameter is refused, named."""

from __future__ import annotations

import pathlib

import numpy as np
import pytest
from flax import nnx

from cbjax import LLM, SamplingParams
from experiments.lib import flax_llama
from tests.tiers import sweep

TEXT = (pathlib.Path(__file__).resolve().parents[1] / "experiments" / "data" / "public_domain.txt").read_text()


@pytest.fixture(scope="module")
def trained():
    tokenizer = flax_llama.train_tokenizer(TEXT, 400)
    ids = tokenizer.encode(TEXT)
    config = flax_llama.TinyConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_heads=4,
                                   num_kv_heads=2, max_len=128)
    model = flax_llama.TinyLlama(config, nnx.Rngs(0))
    losses = flax_llama.train(model, ids, steps=40, seq_len=32, batch=4, lr=1e-2)
    assert losses[-1] < losses[0]
    return model, config, tokenizer, ids


@pytest.mark.parametrize("layout", sweep(flax_llama.LAYOUTS, quick={"stacked"}))
def test_the_engine_equals_the_training_model(trained, layout, tmp_path):
    model, config, tokenizer, ids = trained
    path = flax_llama.save_checkpoint(str(tmp_path / layout), model, config, tokenizer, layout)
    llm = LLM(path, max_seq_len=128, num_slots=2)
    assert llm.tokenizer.encode(TEXT[:200]) == tokenizer.encode(TEXT[:200])
    prompt = ids[:6]
    out = llm.generate([prompt], SamplingParams(max_tokens=16, ignore_eos=True), use_tqdm=False)[0]
    assert out.token_ids == flax_llama.greedy(model, prompt, 16)
    scored = ids[:100]
    out = llm.generate([scored], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    np.testing.assert_allclose([e.logprob for e in out.prompt_logprobs[1:]], flax_llama.token_logprobs(model, scored),
                               atol=1e-4)


def test_a_broken_checkpoint_is_refused_naming_the_parameter(trained, tmp_path):
    model, config, tokenizer, _ = trained

    def save(name, edit):
        params = flax_llama.params_in_layout(model, "nnx")
        edit(params)
        return flax_llama.save_params(str(tmp_path / name), params, config, tokenizer)

    missing = save("missing", lambda p: p["layers"][1]["mlp"].pop("up_proj"))
    with pytest.raises(ValueError, match=r"layers/w_up.*\[1\]"):
        LLM(missing, max_seq_len=64)
    misshapen = save("misshapen", lambda p: p["layers"][0]["attn"]["k_proj"].update(
        kernel=np.zeros((config.hidden_size, 3), np.float32)))
    with pytest.raises(ValueError, match="layers/wk"):
        LLM(misshapen, max_seq_len=64)
    unknown = save("unknown", lambda p: p["layers"][0].update(adapter={"kernel": np.zeros((2, 2), np.float32)}))
    with pytest.raises(ValueError, match="layers/0/adapter/kernel"):
        LLM(unknown, max_seq_len=64)
    stacked = flax_llama.params_in_layout(model, "stacked")
    stacked["layers"]["mlp_norm"]["scale"] = stacked["layers"]["mlp_norm"]["scale"][:1]
    with pytest.raises(ValueError, match="layers/mlp_norm/scale"):
        LLM(flax_llama.save_params(str(tmp_path / "stacked"), stacked, config, tokenizer), max_seq_len=64)

"""Checkpoint loading: orbax round trip, presets, and clear errors for broken inputs."""

from __future__ import annotations

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cbjax.loading import load_hf_dir, load_model, load_orbax, save_orbax
from cbjax.config import ModelConfig
from cbjax.loading.presets import RANDOM_PRESETS
from tests.hf_models import make_hf_model, save_hf_model


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return save_hf_model(make_hf_model("llama"), str(tmp_path_factory.mktemp("llama")))


@pytest.mark.parametrize("spec,dtype", [("tiny-qwen3", "float32"), ("tiny-gpt2", "bfloat16")])
def test_orbax_round_trip_is_bit_identical(spec, dtype, tmp_path):
    model = load_model(spec, dtype=dtype, seed=7)
    save_orbax(model, str(tmp_path / "ckpt"))
    restored = load_model(str(tmp_path / "ckpt"))
    assert restored.config == model.config
    a, b = jax.tree.leaves_with_path(model.params), jax.tree.leaves_with_path(restored.params)
    assert [p for p, _ in a] == [p for p, _ in b]
    for (path, x), (_, y) in zip(a, b):
        assert x.dtype == y.dtype, path
        np.testing.assert_array_equal(np.asarray(x.astype(jnp.float32)), np.asarray(y.astype(jnp.float32)))


def test_orbax_of_hf_checkpoint_keeps_the_tokenizer_source(llama_dir, tmp_path):
    model = load_hf_dir(llama_dir, with_tokenizer=False)
    save_orbax(model, str(tmp_path / "o"))
    restored = load_orbax(str(tmp_path / "o"))
    for x, y in zip(jax.tree.leaves(model.params), jax.tree.leaves(restored.params)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_orbax_checkpoint_in_the_old_matrix_layout_is_refused(tmp_path):
    """Before the layout was recorded, matrices were saved [in, out]: a square one would load
    transposed without a word, so the missing layout is refused by name."""
    import json

    from cbjax.loading.orbax_io import ORBAX_CONFIG_FILE

    save_orbax(load_model("tiny-llama"), str(tmp_path / "old"))
    meta_path = tmp_path / "old" / ORBAX_CONFIG_FILE
    meta = json.loads(meta_path.read_text())
    del meta["params_layout"]
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="in_out.*convert the original checkpoint"):
        load_orbax(str(tmp_path / "old"))


def test_presets_are_seeded():
    a = load_model("tiny-llama", seed=3).params
    b = load_model("tiny-llama", seed=3).params
    c = load_model("tiny-llama", seed=4).params
    np.testing.assert_array_equal(np.asarray(a["embed"]), np.asarray(b["embed"]))
    assert not np.array_equal(np.asarray(a["embed"]), np.asarray(c["embed"]))
    assert set(RANDOM_PRESETS) >= {"tiny-llama", "tiny-mistral", "tiny-qwen2", "tiny-qwen3", "tiny-gpt2"}


def test_unknown_spec_is_a_clear_error():
    with pytest.raises(ValueError, match="cannot load model 'no-such-model'"):
        load_model("no-such-model")
    with pytest.raises(ValueError, match="dtype"):
        load_model("tiny-llama", dtype="int8")


def test_unsupported_model_type_names_it(llama_dir, tmp_path):
    bad = shutil.copytree(llama_dir, tmp_path / "bad")
    cfg = json.loads((bad / "config.json").read_text())
    cfg["model_type"] = "falcon"
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="unsupported model_type 'falcon'"):
        load_hf_dir(str(bad))


def test_missing_weights_file_names_the_directory(llama_dir, tmp_path):
    bad = shutil.copytree(llama_dir, tmp_path / "nofile")
    os.remove(bad / "model.safetensors")
    with pytest.raises(FileNotFoundError, match="no model.safetensors"):
        load_hf_dir(str(bad))
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_hf_dir(str(tmp_path))


def test_missing_shard_names_the_shard(tmp_path):
    path = save_hf_model(make_hf_model("qwen2"), str(tmp_path / "sharded"), max_shard_size="40KB")
    shard = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))[1]
    os.remove(os.path.join(path, shard))
    with pytest.raises(FileNotFoundError, match=shard):
        load_hf_dir(path)


def test_shape_mismatch_names_the_tensor(llama_dir, tmp_path):
    bad = shutil.copytree(llama_dir, tmp_path / "shape")
    cfg = json.loads((bad / "config.json").read_text())
    cfg["intermediate_size"] = 128
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"layers/\d+/w_(gate|up|down)"):
        load_hf_dir(str(bad))


def test_missing_tensor_names_the_tensor(llama_dir, tmp_path):
    from safetensors.numpy import load_file, save_file

    bad = shutil.copytree(llama_dir, tmp_path / "missing")
    tensors = load_file(str(bad / "model.safetensors"))
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, str(bad / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"layers/wk.*\[1\]"):
        load_hf_dir(str(bad))


def test_corrupt_safetensors_is_a_clear_error(llama_dir, tmp_path):
    bad = shutil.copytree(llama_dir, tmp_path / "corrupt")
    (bad / "model.safetensors").write_bytes(b"\x00garbage" * 10)
    with pytest.raises(ValueError, match="model.safetensors: not a readable safetensors file"):
        load_hf_dir(str(bad))


def test_corrupt_gguf_is_a_clear_error(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 64)
    with pytest.raises(ValueError, match="broken.gguf"):
        load_model(str(bad))


def test_hf_config_parsing_handles_v4_and_v5_rope_fields():
    base = dict(model_type="llama", vocab_size=10, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
                intermediate_size=16)
    v4 = ModelConfig.from_hf_dict({**base, "rope_theta": 5e5, "rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}})
    v5 = ModelConfig.from_hf_dict({**base, "rope_parameters": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192, "rope_theta": 5e5}})
    assert v4 == v5 and v4.rope_theta == 5e5 and v4.rope_scaling_dict["rope_type"] == "llama3"
    with pytest.raises(ValueError, match="unsupported rope type 'yarn'"):
        ModelConfig.from_hf_dict({**base, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    with pytest.raises(ValueError, match="num_heads"):
        ModelConfig.from_hf_dict({**base, "num_key_value_heads": 3, "num_attention_heads": 4})

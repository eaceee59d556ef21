"""Converted params saved and restored with orbax, so a large conversion is done once."""

from __future__ import annotations

import json
import os

import jax

from cbjax.config import ModelConfig
from cbjax.loading import huge_pages
from cbjax.loading.model import Model, as_dtype
from cbjax.models import quant
from cbjax.models.params import check_params

ORBAX_CONFIG_FILE = "cbjax_config.json"
ORBAX_PARAMS_DIR = "params"
# Matrices are stored `[out, in]` (cbjax/models/params.py). Checkpoints saved before the
# layout was recorded hold them `[in, out]`; a square matrix would pass the shape check
# transposed, so those are refused by name instead of loaded wrong.
PARAMS_LAYOUT = "out_in"


def save_orbax(model: Model, path: str) -> None:
    """Save converted params (and the config) so a large conversion is done once."""
    import orbax.checkpoint as ocp

    if quant.quantization_of(model.params) == "gguf":
        raise ValueError("save_orbax: a model in GGUF blocks is its .gguf file already (orbax keeps none, int8 "
                         "and fp8 params)")
    path = os.path.abspath(path)
    os.makedirs(path, exist_ok=True)
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(os.path.join(path, ORBAX_PARAMS_DIR), model.params, force=True)
    with open(os.path.join(path, ORBAX_CONFIG_FILE), "w") as f:
        json.dump({"config": model.config.to_dict(), "source": model.source, "params_layout": PARAMS_LAYOUT,
                   "quantization": quant.quantization_of(model.params)}, f, indent=1)


def is_orbax_dir(path: str) -> bool:
    return os.path.isfile(os.path.join(path, ORBAX_CONFIG_FILE))


def load_orbax(path: str, dtype=None) -> Model:
    import orbax.checkpoint as ocp

    path = os.path.abspath(path)
    config_path = os.path.join(path, ORBAX_CONFIG_FILE)
    with open(config_path) as f:
        meta = json.load(f)
    config = ModelConfig.from_dict(meta["config"])
    layout = meta.get("params_layout", "in_out")
    if layout != PARAMS_LAYOUT:
        raise ValueError(f"{config_path}: params saved in the {layout!r} matrix layout, this version stores "
                         f"{PARAMS_LAYOUT!r}; convert the original checkpoint again and save it")
    params_dir = os.path.join(path, ORBAX_PARAMS_DIR)
    if not os.path.isdir(params_dir):
        raise FileNotFoundError(f"{path!r} has {ORBAX_CONFIG_FILE} but no {ORBAX_PARAMS_DIR}/ directory")
    with ocp.StandardCheckpointer() as ckptr:
        stored = ckptr.metadata(params_dir)
        tree = getattr(stored, "item_metadata", stored)
        target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(tuple(m.shape), m.dtype), tree)
        params = quant.rebuild(ckptr.restore(params_dir, target))
    check_params(params, config, source=params_dir)
    if dtype is not None:
        params = quant.cast(params, as_dtype(dtype))
    params = huge_pages.on_huge_pages(params)  # on the CPU, as the other loaders place them
    source = meta.get("source", "")
    tokenizer = None
    if source and os.path.exists(source):
        tokenizer = _tokenizer_for(source)
    return Model(config, params, tokenizer, source=path)


def _tokenizer_for(source: str):
    if source.endswith(".gguf"):
        from cbjax.loading.gguf import load_gguf_tokenizer

        return load_gguf_tokenizer(source)
    from cbjax.loading.huggingface import load_tokenizer

    return load_tokenizer(source)

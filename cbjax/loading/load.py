"""`load_model(spec)`: the one entry point over every format. `spec` is a preset name
(presets.py), a Hugging Face directory, a `.gguf` file, a directory written by
`save_orbax`, or a JAX training run's checkpoint (flax params by orbax, flax_checkpoint.py).
Nothing in cbjax.loading imports this module."""

from __future__ import annotations

import os

from cbjax.loading import presets
from cbjax.loading.flax_checkpoint import is_flax_checkpoint, load_flax_checkpoint
from cbjax.loading.gguf import load_gguf
from cbjax.loading.huggingface import load_hf_dir
from cbjax.loading.model import Model, as_dtype
from cbjax.loading.orbax_io import is_orbax_dir, load_orbax


def load_model(spec: str, dtype=None, seed: int = 0, with_tokenizer: bool = True, keep_gguf_blocks: bool = False
               ) -> Model:
    """A preset name, a Hugging Face directory, a GGUF file or an orbax directory.

    `dtype` None keeps an orbax checkpoint's stored dtype and means float32 otherwise.
    `keep_gguf_blocks`: a GGUF file's quantized matrices stay in its blocks (quantization='gguf')."""
    if keep_gguf_blocks and spec == "smollm2-135m":  # the embedded default is a GGUF file
        spec = presets.smollm2_gguf_path()
    if keep_gguf_blocks and not (isinstance(spec, str) and spec.endswith(".gguf")):
        raise ValueError(f"quantization='gguf' keeps a GGUF file's blocks: {spec!r} is not a .gguf file "
                         "(use quantization='int8' or 'fp8' to quantize other weights)")
    if spec is not None and os.path.isdir(spec) and is_orbax_dir(spec):
        return load_orbax(spec, dtype=dtype)
    dtype = as_dtype("float32" if dtype is None else dtype)
    if spec in presets.PRESETS:
        return presets.load_preset(spec, dtype=dtype, seed=seed, with_tokenizer=with_tokenizer)
    if os.path.isfile(spec) and spec.endswith(".gguf"):
        return load_gguf(spec, dtype=dtype, with_tokenizer=with_tokenizer, keep_blocks=keep_gguf_blocks)
    if os.path.isdir(spec) and is_flax_checkpoint(spec):
        return load_flax_checkpoint(spec, dtype=dtype, with_tokenizer=with_tokenizer)
    if os.path.isdir(spec):
        return load_hf_dir(spec, dtype=dtype, with_tokenizer=with_tokenizer)
    raise ValueError(
        f"cannot load model {spec!r}: not a preset ({', '.join(sorted(presets.PRESETS))}), "
        "a Hugging Face directory, a .gguf file, an orbax directory or a training run's checkpoint")

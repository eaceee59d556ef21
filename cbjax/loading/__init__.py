"""Checkpoints into the params pytree. Layered bottom to top: `model` (the `Model` type,
dtypes, the shared tensor conversion); the formats `huggingface`, `gguf`, `orbax_io`;
`presets` (named configs and the embedded SmolLM2); `load` (`load_model`, the dispatcher)."""

from cbjax.loading.huggingface import load_hf_dir, load_hf_params, load_tokenizer
from cbjax.loading.load import load_model
from cbjax.loading.model import Model, as_dtype, convert_tensors
from cbjax.loading.orbax_io import is_orbax_dir, load_orbax, save_orbax

__all__ = ["Model", "as_dtype", "convert_tensors", "is_orbax_dir", "load_hf_dir", "load_hf_params", "load_model",
           "load_orbax", "load_tokenizer", "save_orbax"]

"""GGUF files (llama.cpp's format), parsed by `gguf_file`, dequantized on load by the `gguf`
package.

Supports the `llama` architecture (Llama, Mistral, SmolLM2 and friends). llama.cpp's
converter permutes the rows of Q and K from Hugging Face's rotate-half RoPE
layout into an interleaved one; `_unpermute` undoes that so the weights fit our
(Hugging Face layout) rotary code.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import glob
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable

import numpy as np

from cbjax.compile_cache import cache_root
from cbjax.loading.model import Model, convert_tensors
from cbjax.config import ModelConfig
from cbjax.loading.gguf_file import GGUFFile
from cbjax.models.gguf_blocks import GGUFWeight, check_kind

SUPPORTED_GGUF_ARCHS = ("llama",)

# (GGUF tensor name pattern, our flat name); ggml stores matrices [out, in] as we do.
_GGUF_NAMES = [
    (r"token_embd\.weight", "embed"),
    (r"output_norm\.weight", "final_norm/scale"),
    (r"output\.weight", "lm_head"),
    (r"blk\.(\d+)\.attn_norm\.weight", "layers/attn_norm/scale"),
    (r"blk\.(\d+)\.ffn_norm\.weight", "layers/mlp_norm/scale"),
    (r"blk\.(\d+)\.attn_q\.weight", "layers/wq"),  # un-permuted by the loader
    (r"blk\.(\d+)\.attn_k\.weight", "layers/wk"),
    (r"blk\.(\d+)\.attn_v\.weight", "layers/wv"),
    (r"blk\.(\d+)\.attn_output\.weight", "layers/wo"),
    (r"blk\.(\d+)\.ffn_gate\.weight", "layers/w_gate"),
    (r"blk\.(\d+)\.ffn_up\.weight", "layers/w_up"),
    (r"blk\.(\d+)\.ffn_down\.weight", "layers/w_down"),
]


def _unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Inverse of llama.cpp's `permute`: rows [heads, hd/2, 2] -> [heads, 2, hd/2]."""
    out_dim, in_dim = w.shape
    return w.reshape(n_heads, out_dim // n_heads // 2, 2, in_dim).swapaxes(1, 2).reshape(out_dim, in_dim)


def _owned(a: np.ndarray) -> np.ndarray:
    """`a`, or a copy of it when it is a view (of the file's map)."""
    return a if a.base is None else np.array(a)


def gguf_config(reader: GGUFFile, path: str) -> ModelConfig:
    arch = reader.get("general.architecture")
    if arch not in SUPPORTED_GGUF_ARCHS:
        raise ValueError(f"{path}: GGUF architecture {arch!r} is not supported ({SUPPORTED_GGUF_ARCHS})")
    if any(t.name == "rope_freqs.weight" for t in reader.tensors):
        raise ValueError(f"{path}: GGUF rope_freqs (Llama 3.1 rope scaling) is not supported; "
                         "load the Hugging Face checkpoint instead")

    def need(key):
        value = reader.get(f"{arch}.{key}")
        if value is None:
            raise ValueError(f"{path}: GGUF metadata has no {arch}.{key}")
        return value

    hidden = int(need("embedding_length"))
    heads = int(need("attention.head_count"))
    tokens = reader.get("tokenizer.ggml.tokens")
    vocab = reader.get(f"{arch}.vocab_size") or (len(tokens) if tokens else None)
    if vocab is None:
        raise ValueError(f"{path}: GGUF metadata has no vocab size")
    eos = reader.get("tokenizer.ggml.eos_token_id")
    eos_ids = {int(eos)} if eos is not None else set()
    if tokens:
        # Chat models end a turn with <|im_end|> / <|eot_id|>: stop there too.
        for special in ("<|im_end|>", "<|eot_id|>", "<|end_of_text|>"):
            if special in tokens:
                eos_ids.add(tokens.index(special))
    bos = reader.get("tokenizer.ggml.bos_token_id")
    return ModelConfig(
        model_type="llama",
        vocab_size=int(vocab),
        hidden_size=hidden,
        num_layers=int(need("block_count")),
        num_heads=heads,
        num_kv_heads=int(reader.get(f"{arch}.attention.head_count_kv", heads)),
        head_dim=int(reader.get(f"{arch}.attention.key_length", hidden // heads)),
        intermediate_size=int(need("feed_forward_length")),
        max_position_embeddings=int(need("context_length")),
        norm_eps=float(need("attention.layer_norm_rms_epsilon")),
        rope_theta=float(reader.get(f"{arch}.rope.freq_base", 10000.0)),
        tie_embeddings=not any(t.name == "output.weight" for t in reader.tensors),
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=tuple(sorted(eos_ids)),
    )


def _cache_dir(kind: str, path: str) -> str:
    """Where something derived from the GGUF file at `path` is kept (under `cache_root()`),
    keyed by the file's name, size and modification time."""
    stat = os.stat(path)
    return str(cache_root() / kind / f"{os.path.basename(path)}-{stat.st_size}-{stat.st_mtime_ns}")


def _tokenizer_cache_dir(path: str) -> str:
    return _cache_dir("tokenizers", path)


def _tokenizer_class(path: str):
    """The class to build a GGUF file's tokenizer with. `AutoTokenizer` parses the whole file a
    second time through the `gguf` package only to learn the model's type (most of a cold
    start's load) and, for a byte-level BPE vocabulary ("gpt2", SmolLM2's) with
    no tokenizer_config.json beside the file, lands in transformers 5's `TokenizersBackend`:
    that class is asked directly then (tests/test_gguf_file.py checks both give one tokenizer).
    Anything else goes through `AutoTokenizer`."""
    import transformers

    backend = getattr(transformers, "TokenizersBackend", None)
    beside = os.path.join(os.path.dirname(os.path.abspath(path)), "tokenizer_config.json")
    if backend is not None and not os.path.exists(beside) and GGUFFile(path).get("tokenizer.ggml.model") == "gpt2":
        return backend
    return transformers.AutoTokenizer


def load_gguf_tokenizer(path: str):
    """transformers' tokenizer from the GGUF metadata, converted once and cached on disk
    (the conversion takes seconds; reading the cached tokenizer.json takes milliseconds)."""
    from transformers import AutoTokenizer

    cached = _tokenizer_cache_dir(path)
    if os.path.isfile(os.path.join(cached, "tokenizer.json")):
        try:
            return AutoTokenizer.from_pretrained(cached)
        except (OSError, ValueError):
            pass  # a damaged cache entry: convert again below
    tokenizer = _tokenizer_class(path).from_pretrained(os.path.dirname(os.path.abspath(path)),
                                                       gguf_file=os.path.basename(path))
    try:
        tokenizer.save_pretrained(cached)
    except OSError:
        pass  # a read-only home is fine: we just convert again next time
    return tokenizer


def _read(path: str, keep_blocks: bool = False) -> tuple[ModelConfig, dict[str, Callable[[], np.ndarray]]]:
    """The config and a loader per tensor: dequantized to float32 in our (Hugging Face) layout,
    one tensor at a time; with `keep_blocks`, a quantized matrix as its own blocks instead
    (`GGUFWeight`, rows in our layout: un-permuting Q and K moves whole rows of blocks)."""
    import gguf

    reader = GGUFFile(path)
    config = gguf_config(reader, path)

    def load(t):
        # Copied out of the file's map: one view left in the params (jax keeps an f32 norm on the
        # CPU without a copy) held the whole map, 93 MB of SmolLM2 Q4_1's pages resident beside
        # the matrices' own copies.
        w = read(t)
        if isinstance(w, GGUFWeight):
            return GGUFWeight(_owned(w.blocks), w.kind)
        return _owned(w)

    def read(t):
        kind = t.tensor_type.name
        if keep_blocks and kind not in ("F32", "F16", "BF16"):
            check_kind(kind, f"{path}: tensor {t.name!r}")
            w = np.asarray(t.data, np.uint8)
            if t.name.endswith(("attn_q.weight", "attn_k.weight")):
                w = _unpermute(w, config.num_heads if t.name.endswith("attn_q.weight") else config.num_kv_heads)
            return GGUFWeight(w, kind)
        try:
            w = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), np.float32)
        except (NotImplementedError, ValueError) as e:
            raise ValueError(f"{path}: cannot dequantize tensor {t.name!r} ({t.tensor_type.name}): {e}") from e
        if t.name.endswith("attn_q.weight"):
            return _unpermute(w, config.num_heads)
        if t.name.endswith("attn_k.weight"):
            return _unpermute(w, config.num_kv_heads)
        return w

    return config, {t.name: functools.partial(load, t) for t in reader.tensors}


# Reading a GGUF file costs seconds (parsing its metadata, dequantizing), most of a warm
# server start; the float32 tensors it yields are kept as .npy files beside the tokenizer and
# memory-mapped on the next load (docs/engine.md, "The step's figures"). The key holds this
# module's source, so a change to the conversion converts again.
_CONVERTER = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:12]


def _converted_dir(path: str) -> str:
    return f"{_cache_dir('converted', path)}-{_CONVERTER}"


def _read_converted(path: str) -> tuple[ModelConfig, dict[str, Callable[[], np.ndarray]]] | None:
    cached = _converted_dir(path)
    try:
        with open(os.path.join(cached, "config.json")) as f:
            saved = json.load(f)
        config = ModelConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in saved["config"].items()})
        # Mapped here (reading nothing yet), so a damaged file shows now and converts again.
        mapped = {name: np.load(os.path.join(cached, f"{i}.npy"), mmap_mode="r")
                  for i, name in enumerate(saved["tensors"])}
    except (OSError, ValueError, KeyError, TypeError):  # absent or damaged: convert again
        return None
    return config, {name: functools.partial(np.asarray, w) for name, w in mapped.items()}


def _write_converted(path: str, config: ModelConfig, loaders: dict[str, Callable[[], np.ndarray]]) -> bool:
    """Convert every tensor into the cache, one at a time (a float32 copy of the whole model never
    sits in memory). False when the disk would not take it."""
    cached = _converted_dir(path)
    tmp = None
    try:
        os.makedirs(os.path.dirname(cached), exist_ok=True)
        tmp = tempfile.mkdtemp(dir=os.path.dirname(cached))
        for i, load in enumerate(loaders.values()):
            np.save(os.path.join(tmp, f"{i}.npy"), load())
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump({"config": dataclasses.asdict(config), "tensors": list(loaders)}, f)
        shutil.rmtree(cached, ignore_errors=True)  # a damaged entry
        os.rename(tmp, cached)  # whole or absent, whatever runs beside us
        # Entries of this file's earlier versions, or of an earlier converter, are a model's
        # size each on disk: they go.
        for stale in glob.glob(os.path.join(os.path.dirname(cached), glob.escape(os.path.basename(path)) + "-*")):
            if stale != cached:
                shutil.rmtree(stale, ignore_errors=True)
        return True
    except OSError:  # a read-only or full disk (or another process won the race): convert next time
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        return False


def load_gguf(path: str, dtype="float32", with_tokenizer: bool = True, keep_blocks: bool = False) -> Model:
    """`keep_blocks`: quantized matrices stay in the file's blocks (quantization='gguf'), read
    straight from the file; else every tensor in `dtype` (converted once and cached)."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"GGUF file {path!r} does not exist")
    converted = _read(path, keep_blocks=True) if keep_blocks else _read_converted(path)
    if converted is None:
        config, loaders = _read(path)
        # Read back mapped when the cache took it; else converted again, tensor by tensor, below.
        converted = (_write_converted(path, config, loaders) and _read_converted(path)) or (config, loaders)
    config, loaders = converted
    names = [(p, ours, lambda w: w) for p, ours in _GGUF_NAMES]
    params = convert_tensors(loaders, config, names, dtype, lambda n: path)
    tokenizer = load_gguf_tokenizer(path) if with_tokenizer else None
    del converted, loaders  # the reader and its map
    _release_freed_heap()
    return Model(config, params, tokenizer, source=os.path.abspath(path))


def _release_freed_heap() -> None:
    """Hand the heap the reader freed back to the system: glibc keeps it otherwise (SmolLM2 Q4_1:
    its metadata's Python objects and the tensors' host copies, ~80 MB of RSS after the load)."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError, TypeError):  # not glibc
        pass

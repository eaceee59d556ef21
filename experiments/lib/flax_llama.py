"""A tiny Llama in flax NNX, trained with optax and saved with orbax as a JAX training run
leaves its checkpoint (experiments/studies/train_tiny.py): the params, the model's config as a
Hugging Face `config.json`, and the tokenizer, in one directory that cbjax loads as it is
(cbjax/loading/flax_checkpoint.py).

The model is Llama's: RMSNorm before attention and MLP, rotary positions on half-split
features, grouped-query attention, a SwiGLU MLP, an untied head. Its params are saved in one of
three layouts, the ones the loader reads: `nnx` (the NNX state as plain nested dicts, list
indices as keys), `linen` (linen's naming, `{"params": {"layers_0": ...}}`) and `stacked` (one
`layers` subtree whose arrays have a leading layer axis, as `nn.scan` and jax-llm-examples
keep them).
"""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

LAYOUTS = ("nnx", "linen", "stacked")


@dataclasses.dataclass(frozen=True)
class TinyConfig:
    vocab_size: int = 512
    hidden_size: int = 64
    intermediate_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    max_len: int = 128
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def hf_config(self, bos: int, eos: int) -> dict:
        """The config.json of a transformers Llama with these shapes."""
        return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": self.vocab_size,
                "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
                "num_hidden_layers": self.num_layers, "num_attention_heads": self.num_heads,
                "num_key_value_heads": self.num_kv_heads, "head_dim": self.head_dim,
                "max_position_embeddings": self.max_len, "rope_theta": self.rope_theta,
                "rms_norm_eps": self.rms_norm_eps, "tie_word_embeddings": False, "hidden_act": "silu",
                "bos_token_id": bos, "eos_token_id": eos, "torch_dtype": "float32"}


def rotary(x, positions, theta: float):
    """Llama's rotary embedding: the features' two halves rotated by position-dependent angles."""
    half = x.shape[-1] // 2
    freqs = 1.0 / theta ** (jnp.arange(half, dtype=jnp.float32) * 2 / x.shape[-1])
    angles = positions[:, None].astype(jnp.float32) * freqs[None, :]
    cos, sin = jnp.cos(angles)[:, None, :], jnp.sin(angles)[:, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


class Attention(nnx.Module):
    def __init__(self, c: TinyConfig, rngs: nnx.Rngs):
        self.c = c
        self.q_proj = nnx.Linear(c.hidden_size, c.num_heads * c.head_dim, use_bias=False, rngs=rngs)
        self.k_proj = nnx.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, use_bias=False, rngs=rngs)
        self.v_proj = nnx.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, use_bias=False, rngs=rngs)
        self.o_proj = nnx.Linear(c.num_heads * c.head_dim, c.hidden_size, use_bias=False, rngs=rngs)

    def __call__(self, x):  # [B, T, hidden]
        c = self.c
        b, t, _ = x.shape
        positions = jnp.arange(t)
        q = rotary(self.q_proj(x).reshape(b, t, c.num_heads, c.head_dim), positions, c.rope_theta)
        k = rotary(self.k_proj(x).reshape(b, t, c.num_kv_heads, c.head_dim), positions, c.rope_theta)
        v = self.v_proj(x).reshape(b, t, c.num_kv_heads, c.head_dim)
        group = c.num_heads // c.num_kv_heads
        k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(c.head_dim)
        scores = jnp.where(jnp.tril(jnp.ones((t, t), bool)), scores, -1e30)
        out = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v)
        return self.o_proj(out.reshape(b, t, -1))


class Mlp(nnx.Module):
    def __init__(self, c: TinyConfig, rngs: nnx.Rngs):
        self.gate_proj = nnx.Linear(c.hidden_size, c.intermediate_size, use_bias=False, rngs=rngs)
        self.up_proj = nnx.Linear(c.hidden_size, c.intermediate_size, use_bias=False, rngs=rngs)
        self.down_proj = nnx.Linear(c.intermediate_size, c.hidden_size, use_bias=False, rngs=rngs)

    def __call__(self, x):
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nnx.Module):
    def __init__(self, c: TinyConfig, rngs: nnx.Rngs):
        self.attn_norm = nnx.RMSNorm(c.hidden_size, epsilon=c.rms_norm_eps, rngs=rngs)
        self.attn = Attention(c, rngs)
        self.mlp_norm = nnx.RMSNorm(c.hidden_size, epsilon=c.rms_norm_eps, rngs=rngs)
        self.mlp = Mlp(c, rngs)

    def __call__(self, x):
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class TinyLlama(nnx.Module):
    def __init__(self, c: TinyConfig, rngs: nnx.Rngs):
        self.embed = nnx.Embed(c.vocab_size, c.hidden_size, rngs=rngs)
        self.layers = nnx.List([Block(c, rngs) for _ in range(c.num_layers)])
        self.final_norm = nnx.RMSNorm(c.hidden_size, epsilon=c.rms_norm_eps, rngs=rngs)
        self.lm_head = nnx.Linear(c.hidden_size, c.vocab_size, use_bias=False, rngs=rngs)

    def __call__(self, tokens):  # [B, T] -> logits [B, T, vocab]
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.final_norm(x))


def loss_fn(model: TinyLlama, batch):
    """Mean next-token cross-entropy over the batch's windows."""
    logits = model(batch[:, :-1])
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, batch[:, 1:, None], axis=-1))


@nnx.jit
def train_step(model: TinyLlama, optimizer: nnx.Optimizer, batch):
    loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
    optimizer.update(model, grads)
    return loss


def windows(ids: list[int], length: int, batch: int, rng: np.random.Generator) -> np.ndarray:
    """`batch` random windows of `length` tokens of `ids`."""
    starts = rng.integers(0, len(ids) - length, batch)
    return np.stack([np.asarray(ids[s:s + length], np.int32) for s in starts])


def train(model: TinyLlama, ids: list[int], steps: int, seq_len: int, batch: int, lr: float, seed: int = 0,
          progress=None) -> list[float]:
    """`steps` of AdamW on random windows of `ids`; the losses."""
    import optax

    optimizer = nnx.Optimizer(model, optax.adamw(optax.warmup_cosine_decay_schedule(0.0, lr, steps // 10 + 1, steps)),
                              wrt=nnx.Param)
    rng = np.random.default_rng(seed)
    losses = []
    for _ in range(steps):
        losses.append(float(train_step(model, optimizer, windows(ids, seq_len + 1, batch, rng))))
        if progress is not None:
            progress(losses[-1])
    return losses


def greedy(model: TinyLlama, prompt: list[int], new_tokens: int) -> list[int]:
    """The model's own greedy continuation: the whole sequence through it at every step."""
    tokens = list(prompt)
    for _ in range(new_tokens):
        logits = model(jnp.asarray([tokens], jnp.int32))
        tokens.append(int(jnp.argmax(logits[0, -1])))
    return tokens[len(prompt):]


def token_logprobs(model: TinyLlama, ids: list[int]) -> np.ndarray:
    """Each token's log-probability after the ones before it (the first has none)."""
    logits = model(jnp.asarray([ids], jnp.int32))[0, :-1]
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return np.asarray(jnp.take_along_axis(logp, jnp.asarray(ids[1:])[:, None], axis=-1)[:, 0])


def params_in_layout(model: TinyLlama, layout: str) -> dict:
    """The trained params as plain nested dicts of arrays, in one of `LAYOUTS`."""
    state = nnx.state(model, nnx.Param).to_pure_dict()
    if layout == "nnx":
        return jax.tree.map(np.asarray, state)
    layers = [state["layers"][i] for i in sorted(state["layers"])]
    rest = {k: v for k, v in state.items() if k != "layers"}
    if layout == "linen":
        return jax.tree.map(np.asarray, {"params": {**rest, **{f"layers_{i}": p for i, p in enumerate(layers)}}})
    if layout == "stacked":
        return jax.tree.map(np.asarray, {**rest, "layers": jax.tree.map(lambda *a: np.stack(a), *layers)})
    raise ValueError(f"unknown layout {layout!r}: one of {', '.join(LAYOUTS)}")


def save_checkpoint(path: str, model: TinyLlama, config: TinyConfig, tokenizer, layout: str) -> str:
    """The directory a training run leaves: orbax params (`params/`), config.json and the tokenizer."""
    return save_params(path, params_in_layout(model, layout), config, tokenizer)


def save_params(path: str, params: dict, config: TinyConfig, tokenizer) -> str:
    """`params` (nested dicts of arrays) saved by orbax beside config.json and the tokenizer."""
    import orbax.checkpoint as ocp

    path = os.path.abspath(path)
    os.makedirs(path, exist_ok=True)
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(os.path.join(path, "params"), _string_keys(params), force=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config.hf_config(tokenizer.bos_token_id, tokenizer.eos_token_id), f, indent=1)
    tokenizer.save_pretrained(path)
    return path


def _string_keys(tree):
    """Nested dicts with every key a string (orbax's paths; an NNX list's indices are ints)."""
    if isinstance(tree, dict):
        return {str(k): _string_keys(v) for k, v in tree.items()}
    return tree


def train_tokenizer(text: str, vocab_size: int):
    """A byte-level BPE tokenizer trained on `text` (any text encodes), with BOS and EOS."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>", "<|end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(text.split("\n"), trainer)
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|end|>",
                                                pad_token="<|endoftext|>")

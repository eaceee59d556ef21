"""An output-length predictor for length-aware scheduling (ordering="sjf" / "score").

A small flax MLP reads features a scheduler has when a request arrives, before any
prefill: the mean of the serving model's own input embeddings over the prompt's tokens
(a bag of the model's token vectors) and the log of the prompt length. It predicts
log(1 + output tokens). Training (optax) mixes a squared error on that target, so the
prediction is in tokens, with a pairwise logistic ranking loss over the batch (learning
to rank, as Fu et al. 2024), so that the order of lengths is what it learns first.

A checkpoint is a directory: `length_predictor.json` (the features, the standardization,
the model it was made for) and `params/` (orbax). It belongs to one model: loading it
against another (other vocabulary or hidden size, other embedding values) is refused.
"""

from __future__ import annotations

import dataclasses
import json
import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from cbjax import shipped_predictors
from cbjax.models.quant import QuantizedWeight

META_FILE = "length_predictor.json"
PARAMS_DIR = "params"
FEATURES = "mean_input_embedding+log_prompt_len"
FINGERPRINT_ROWS = (0, 1, 2, 100, 1000)  # embedding rows (first 16 values) that identify the model
FINGERPRINT_TOLERANCE = 0.05  # relative difference: bf16 vs f32 of one model passes, another model does not


class LengthMLP(nn.Module):
    hidden: int = 64

    @nn.compact
    def __call__(self, x):  # [n, features] standardized -> [n] predicted log(1 + output tokens)
        x = nn.gelu(nn.Dense(self.hidden)(x))
        x = nn.gelu(nn.Dense(self.hidden)(x))
        return nn.Dense(1)(x)[..., 0]


def embedding_table(model) -> np.ndarray:
    """The serving model's input embeddings on the host (its own dtype, rows gathered later)."""
    embed = model.params["embed"]
    return np.asarray(jax.device_get(embed.dequantize(embed.scale.dtype) if isinstance(embed, QuantizedWeight)
                                     else embed))


def prompt_features(embed: np.ndarray, prompts) -> np.ndarray:
    """`[len(prompts), hidden + 1]` float32 features of token-id lists."""
    out = np.empty((len(prompts), embed.shape[1] + 1), np.float32)
    for i, ids in enumerate(prompts):
        out[i, :-1] = embed[np.asarray(ids)].astype(np.float32).mean(axis=0)
        out[i, -1] = np.log(len(ids))
    return out


def fingerprint(embed: np.ndarray) -> list[list[float]]:
    rows = [r for r in FINGERPRINT_ROWS if r < embed.shape[0]]
    return embed[rows, :16].astype(np.float32).tolist()


def kendall_tau(a, b) -> float:
    """Kendall's tau-b between two sequences (ties in either count as neither order)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    da = np.sign(a[:, None] - a[None, :])
    db = np.sign(b[:, None] - b[None, :])
    concordant = (da * db).sum() / 2
    pairs_a, pairs_b = (da != 0).sum() / 2, (db != 0).sum() / 2
    return float(concordant / np.sqrt(pairs_a * pairs_b)) if pairs_a and pairs_b else 0.0


@dataclasses.dataclass
class LengthPredictor:
    params: dict
    mean: np.ndarray  # feature standardization
    std: np.ndarray
    meta: dict
    embed: np.ndarray | None = None  # the serving model's embeddings (set by `load`)

    def __post_init__(self):
        self._apply = jax.jit(LengthMLP(int(self.meta.get("hidden", 64))).apply)

    def predict_features(self, features: np.ndarray) -> np.ndarray:
        """Predicted output tokens (float, >= 1) for `[n, F]` features."""
        x = (features - self.mean) / self.std
        log_len = np.asarray(self._apply({"params": self.params}, jnp.asarray(x, jnp.float32)))
        return np.maximum(np.expm1(log_len), 1.0)

    def predict_many(self, prompts) -> np.ndarray:
        return self.predict_features(prompt_features(self.embed, prompts))

    def __call__(self, prompt_token_ids) -> int:
        """Predicted output tokens of one prompt: the scheduler's `predicted_len`."""
        return int(round(float(self.predict_many([prompt_token_ids])[0])))

    # -------------------------------------------------------------- training
    @classmethod
    def train(cls, features: np.ndarray, lengths, *, meta: dict, epochs: int = 300, batch_size: int = 128,
              learning_rate: float = 3e-3, weight_decay: float = 1e-3, rank_weight: float = 1.0,
              hidden: int = 64, seed: int = 0, progress=None) -> "LengthPredictor":
        import optax

        mean = features.mean(axis=0)
        std = features.std(axis=0) + 1e-6
        x_all = jnp.asarray((features - mean) / std, jnp.float32)
        y_all = jnp.asarray(np.log1p(np.asarray(lengths, np.float64)), jnp.float32)
        module = LengthMLP(hidden)
        params = module.init(jax.random.key(seed), x_all[:1])["params"]
        opt = optax.adamw(learning_rate, weight_decay=weight_decay)
        state = opt.init(params)

        def loss_fn(p, x, y):
            pred = module.apply({"params": p}, x)
            mse = jnp.mean((pred - y) ** 2)
            # Pairwise logistic loss over the batch's pairs of different lengths.
            sign = jnp.sign(y[:, None] - y[None, :])
            margin = (pred[:, None] - pred[None, :]) * sign
            rank = jnp.sum(jnp.where(sign != 0, jax.nn.softplus(-margin), 0.0)) / jnp.maximum(
                jnp.sum(sign != 0), 1)
            return mse + rank_weight * rank

        @jax.jit
        def step(p, s, x, y):
            loss, grads = jax.value_and_grad(loss_fn)(p, x, y)
            updates, s = opt.update(grads, s, p)
            return optax.apply_updates(p, updates), s, loss

        rng = np.random.default_rng(seed)
        n = x_all.shape[0]
        for epoch in range(epochs):
            order = rng.permutation(n)
            for i in range(0, n - batch_size // 2, batch_size):
                idx = order[i:i + batch_size]
                params, state, loss = step(params, state, x_all[idx], y_all[idx])
            if progress is not None:
                progress(epoch, float(loss))
        meta = {**meta, "features": FEATURES, "hidden": hidden, "target": "log1p(output_tokens)"}
        return cls(jax.device_get(params), mean.astype(np.float32), std.astype(np.float32), meta)

    # ------------------------------------------------------------- save/load
    def save(self, path: str) -> None:
        import orbax.checkpoint as ocp

        path = os.path.abspath(path)
        os.makedirs(path, exist_ok=True)
        with ocp.StandardCheckpointer() as ckptr:
            ckptr.save(os.path.join(path, PARAMS_DIR), self.params, force=True)
        with open(os.path.join(path, META_FILE), "w") as f:
            json.dump({**self.meta, "mean": self.mean.tolist(), "std": self.std.tolist()}, f, indent=1)

    @classmethod
    def load(cls, path: str, model) -> "LengthPredictor":
        """The predictor saved at `path` (or shipped under that name: cbjax/shipped_predictors.py),
        checked against the serving `model`."""
        path = os.path.abspath(shipped_predictors.predictor_dir(path))  # orbax restores from absolute paths only
        meta_path = os.path.join(path, META_FILE)
        try:
            with open(meta_path) as f:
                meta = json.load(f)
            mean, std = np.asarray(meta.pop("mean"), np.float32), np.asarray(meta.pop("std"), np.float32)
            hidden, made_for = int(meta["hidden"]), meta["model"]
            features = meta["features"]
        except FileNotFoundError:
            raise FileNotFoundError(f"length predictor {path!r}: no {META_FILE} (not a predictor checkpoint)") from None
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"length predictor {meta_path}: broken metadata ({type(e).__name__}: {e})") from None
        if features != FEATURES:
            raise ValueError(f"length predictor {meta_path}: features {features!r}, this version reads {FEATURES!r}")
        embed = embedding_table(model)
        vocab, width = embed.shape
        if (made_for.get("vocab_size"), made_for.get("hidden_size")) != (vocab, width) or not _same_values(
                made_for.get("fingerprint"), fingerprint(embed)):
            raise ValueError(f"length predictor {path!r} was made for model {made_for.get('name')!r} (vocabulary "
                             f"{made_for.get('vocab_size')}, hidden {made_for.get('hidden_size')}); the engine "
                             f"serves another (vocabulary {vocab}, hidden {width}, other embeddings)")
        if mean.shape != (width + 1,) or std.shape != (width + 1,):
            raise ValueError(f"length predictor {meta_path}: standardization of {mean.shape} features, the "
                             f"model has {width + 1}")
        params = _restore(os.path.join(path, PARAMS_DIR), hidden, width + 1)
        return cls(params, mean, std, meta, embed)


def model_identity(name: str, embed: np.ndarray) -> dict:
    """What a checkpoint records about the model it was made for."""
    return {"name": name, "vocab_size": int(embed.shape[0]), "hidden_size": int(embed.shape[1]),
            "fingerprint": fingerprint(embed)}


def _same_values(stored, current) -> bool:
    try:
        a, b = np.asarray(stored, np.float64), np.asarray(current, np.float64)
    except (TypeError, ValueError):
        return False
    if a.shape != b.shape:
        return False
    return bool(np.linalg.norm(a - b) <= FINGERPRINT_TOLERANCE * max(np.linalg.norm(b), 1e-12))


def _restore(params_dir: str, hidden: int, num_features: int) -> dict:
    import orbax.checkpoint as ocp

    target = jax.eval_shape(lambda: LengthMLP(hidden).init(
        jax.random.key(0), jnp.zeros((1, num_features), jnp.float32))["params"])
    if not os.path.isdir(params_dir):
        raise FileNotFoundError(f"length predictor: no {PARAMS_DIR}/ directory at {params_dir!r}")
    try:
        with ocp.StandardCheckpointer() as ckptr:
            params = ckptr.restore(params_dir, target)
    except Exception as e:  # orbax raises several types for missing or mis-shaped arrays
        raise ValueError(f"length predictor {params_dir!r}: cannot restore the MLP's params "
                         f"({type(e).__name__}: {str(e)[:200]})") from None
    shapes = jax.tree.map(lambda a: tuple(a.shape), params)
    if shapes != jax.tree.map(lambda a: tuple(a.shape), target):
        raise ValueError(f"length predictor {params_dir!r}: cannot restore the MLP's params: stored shapes "
                         f"{shapes} do not match a {hidden}-wide MLP on {num_features} features")
    return jax.device_get(params)

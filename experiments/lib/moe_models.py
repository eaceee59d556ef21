"""What the MoE benchmark and study share: a mixture of experts and the dense models it is compared
with, one shape but their MLPs, and their decode step timed by the engine over the batch size."""

from __future__ import annotations

from experiments.lib import common

# The MoE flags' defaults: Mixtral's proportions (the experts hold most of the weights) at a size a
# 2-core CPU decodes in milliseconds, memory-bound.
DEFAULTS = dict(hidden=512, layers=4, experts=8, top_k=2, expert_width=1792, vocab=8192)


def define_flags(flags) -> None:
    """The shape flags of `configs`."""
    d = DEFAULTS
    flags.DEFINE_integer("hidden", d["hidden"], "Hidden size of the models.", lower_bound=16)
    flags.DEFINE_integer("layers", d["layers"], "Decoder layers.", lower_bound=1)
    flags.DEFINE_integer("experts", d["experts"], "Experts per MoE layer.", lower_bound=2)
    flags.DEFINE_integer("top_k", d["top_k"], "Experts per token.", lower_bound=1)
    flags.DEFINE_integer("expert_width", d["expert_width"], "Each expert's intermediate size (Mixtral: 3.5 x hidden).",
                         lower_bound=1)
    flags.DEFINE_integer("vocab", d["vocab"], "Vocabulary (small, so that the experts dominate the weights as in "
                         "Mixtral).", lower_bound=16)
    flags.register_multi_flags_validator(["top_k", "experts"], lambda f: f["top_k"] <= f["experts"],
                                         "--top_k must not exceed --experts")


def configs(flag_values, names=("moe", "dense_active", "dense_all")) -> list:
    """(name, ModelConfig) of `names`: `moe` (the experts), `dense_active` (one MLP as wide as the
    experts a token uses: the same active parameters), `dense_all` (as wide as every expert)."""
    from cbjax.experimental import ModelConfig

    f = flag_values
    heads = max(1, f.hidden // 64)
    shape = dict(vocab_size=f.vocab, hidden_size=f.hidden, num_layers=f.layers, num_heads=heads,
                 num_kv_heads=heads // 4 if heads % 4 == 0 else heads, head_dim=f.hidden // heads,
                 max_position_embeddings=4096, norm_eps=1e-5, eos_token_ids=(2,), bos_token_id=1)
    width, experts, k = f.expert_width, f.experts, f.top_k
    made = {"moe": ModelConfig(model_type="mixtral", intermediate_size=width, num_experts=experts,
                               num_experts_per_tok=k, moe_intermediate_size=width, norm_topk_prob=True, **shape),
            "dense_active": ModelConfig(model_type="llama", intermediate_size=k * width, **shape),
            "dense_all": ModelConfig(model_type="llama", intermediate_size=experts * width, **shape)}
    return [(n, made[n]) for n in names]


def seconds_per_step(config, batches: list[int], prompt_len: int, steps: int, repeats: int, progress=None) -> dict:
    """{B: seconds per decode step with B sequences decoding}, a random-init model of `config` on one
    engine (merge_mode chunked: a step computes only its active rows)."""
    import numpy as np

    from cbjax import LLM
    from cbjax.experimental import init_params, Model

    model = Model(config, init_params(config, seed=0), None, source=f"moe_models:{config.model_type}")
    most = max(batches)
    llm = LLM(model, num_slots=most, max_seq_len=prompt_len + steps + 48, merge_mode="chunked",
              max_num_batched_tokens=max(2 * most, prompt_len * most))
    rng = np.random.default_rng(0)
    out = {}
    for b in batches:
        out[b] = common.seconds_per_decode_step(llm, config.vocab_size, b, prompt_len, steps, repeats, rng)
        if progress is not None:
            progress.update(1)
    return out


def expected_experts(experts: int, top_k: int, batch: int) -> float:
    """Experts a layer reads at `batch` tokens under uniform routing."""
    return experts * (1 - (1 - top_k / experts) ** batch)

"""bench_device.py's `moe` section: a Mixtral-shaped decode step on one device.

Mixtral-8x7B's layer (hidden 4096, 8 experts of 14336, top 2, GQA 32/8) with 8 of its 32 layers,
so that its bf16 weights (about 12 GB) fit one device. Beside it, a dense model of the same layers
with one MLP as wide as the two experts a token uses (the same active parameters). Both engines
decode at each of --batches. Each row gives:

- ms per step;
- the experts a layer reads at that batch under uniform routing, E (1 - (1 - k/E)^B);
- the roofline: the weights a step reads (the dense part and the experts read) plus the live KV,
  over the copy bandwidth;
- the measured tokens per expert (the engine's stats) and their imbalance.
"""

from __future__ import annotations

from experiments.lib.device_common import (LLAMA3_8B, TINY, batches, budget, build_engine, decode_ms, decode_shape,
                                           device_model)
from experiments.lib.device_copy import suspect

MIXTRAL_LAYERS = dict(LLAMA3_8B, model_type="mixtral", vocab_size=32000, num_layers=8, rope_theta=1e6,
                      eos_token_ids=(2,), bos_token_id=1, num_experts=8, num_experts_per_tok=2,
                      moe_intermediate_size=14336, norm_topk_prob=True)
TINY_MOE = dict(TINY, model_type="mixtral", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                norm_topk_prob=True)


def moe_decode(copy_GBps: float, tiny: bool) -> dict:
    """The section's rows: per model (moe, dense of its active parameters), per batch."""
    import jax

    from cbjax.experimental import activation_dtype

    moe_shape = TINY_MOE if tiny else MIXTRAL_LAYERS
    dense_shape = dict({k: v for k, v in moe_shape.items() if k not in ("num_experts", "num_experts_per_tok",
                                                                         "moe_intermediate_size", "norm_topk_prob")},
                       model_type="llama", intermediate_size=2 * moe_shape["moe_intermediate_size"])
    prompt_len, warm, timed = decode_shape()
    out = {}
    for name, shape in (("moe", moe_shape), ("dense_active", dense_shape)):
        model = device_model(shape)
        c = model.config
        itemsize = activation_dtype(model.params).itemsize
        weights = sum(a.nbytes for a in jax.tree.leaves(model.params))
        expert_bytes = sum(a.nbytes for p in model.params["layers"] for n, a in p.items() if n.startswith("moe_w_"))
        llm, startup = build_engine(model, "paged", "auto", max(batches()), budget(prompt_len, warm, timed, 1))
        rows = {}
        for batch in batches():
            ms = decode_ms(llm, batch, prompt_len, warm, timed)
            read = c.num_experts * (1 - (1 - c.num_experts_per_tok / c.num_experts) ** batch) if c.is_moe else 0.0
            kv = batch * (prompt_len + warm + timed // 2) * 2 * c.num_layers * c.num_kv_heads * c.head_dim * itemsize
            step_bytes = weights - expert_bytes + (expert_bytes * read / c.num_experts if c.is_moe else 0) + kv
            floor = step_bytes / copy_GBps / 1e6
            rows[batch] = {"ms": ms, "experts_read": read, "roofline_ms": floor, "of_roofline": floor / ms}
        stats = llm.stats
        out[name] = {"startup_s": startup, "weights_GB": weights / 1e9, "steps": rows,
                     "expert_imbalance": stats.expert_imbalance,
                     "expert_tokens": None if stats.expert_tokens is None else stats.expert_tokens.tolist()}
        del llm, model
    return out


def moe_lines(results: dict, line) -> None:
    """The section's lines of bench_device's table."""
    moe = results.get("moe", {})
    for name, r in moe.items():
        line("moe", f"{name} start-up ({r['weights_GB']:.1f} GB)", f"{r['startup_s']:.1f} s")
        for batch, s in r["steps"].items():
            dense = moe.get("dense_active", {}).get("steps", {}).get(batch)
            vs = f", {s['ms'] / dense['ms']:.2f}x dense" if dense and name == "moe" else ""
            read = f"{s['experts_read']:.1f} experts, " if name == "moe" else ""
            line("moe", f"{name} batch {batch}", f"{s['ms']:.2f} ms ({read}{suspect(s['of_roofline'])}{vs})")
        if name == "moe":
            line("moe", "moe expert imbalance (max/mean)", f"{r['expert_imbalance']:.2f}")

"""Random-init LoRA adapters made by PEFT (`get_peft_model`, non-zero B), saved as PEFT
directories beside a tiny base model (tests/hf_models.py), and the reference greedy tokens of
transformers + PEFT."""

from __future__ import annotations

import functools
import json
import os
import tempfile

import torch
from peft import LoraConfig, get_peft_model

from tests.hf_models import make_hf_model, save_hf_model

ALL_SEVEN = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# (targets, rank, alpha, rslora) of the adapters a family's fixture makes, in order
SPECS = [(["q_proj", "v_proj"], 4, 8, False), (ALL_SEVEN, 8, 16, True), (["o_proj", "down_proj"], 2, 4, False),
         (["k_proj", "gate_proj", "up_proj"], 6, 3, False)]


def make_adapter(family: str, seed: int, path: str, targets, rank: int = 4, alpha: float = 8,
                 rslora: bool = False, **overrides):
    """A PEFT model over the family's base (seed 0) with random A and B, saved at `path`."""
    torch.manual_seed(1000 + seed)
    model = get_peft_model(make_hf_model(family, **overrides),
                           LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, use_rslora=rslora,
                                      init_lora_weights=False))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.3)
    model.save_pretrained(path)
    return model.eval()


@functools.lru_cache(maxsize=None)
def family_adapters(family: str, count: int = 2):
    """(base directory, base model, [(adapter path, PEFT model)]) of `family`, made once per process."""
    root = tempfile.mkdtemp(prefix=f"cbjax-lora-{family}-")
    base = make_hf_model(family)
    save_hf_model(base, os.path.join(root, "base"))
    adapters = []
    for i, (targets, rank, alpha, rslora) in enumerate(SPECS[:count]):
        path = os.path.join(root, f"adapter{i}")
        adapters.append((path, make_adapter(family, i, path, targets, rank, alpha, rslora)))
    return os.path.join(root, "base"), base, adapters


def greedy(model, prompt: list[int], max_tokens: int) -> list[int]:
    """transformers + PEFT's greedy tokens, up to EOS (as `SamplingParams` without ignore_eos)."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=max_tokens, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def edit_config(path: str, **changes) -> None:
    file = os.path.join(path, "adapter_config.json")
    with open(file) as f:
        config = json.load(f)
    config.update(changes)
    with open(file, "w") as f:
        json.dump(config, f)

"""The transformers peers the experiments compare against, on the same checkpoint.

- `static_generate`: `model.generate` over fixed batches, each run to its longest
  member (static batching as people do it with transformers);
- `continuous_generate_batch`: transformers' own continuous batching manager.

Both are greedy with EOS ignored, so every request makes exactly its budget; both
return (useful output tokens, seconds).
"""

from __future__ import annotations

import os
import time

import numpy as np


def load_peer(spec: str):
    """A transformers model for a GGUF file, a Hugging Face directory or the smollm2 preset;
    None for random-init presets (no transformers twin)."""
    try:
        import torch
        import transformers
    except ImportError as e:
        print(f"transformers peers need PyTorch (pip install 'cbjax[peers]'): {e}")
        return None

    from cbjax.presets import PRESETS, smollm2_gguf_path

    if spec == "smollm2-135m":
        spec = smollm2_gguf_path()
    elif spec in PRESETS:
        return None
    if spec.endswith(".gguf"):
        return transformers.AutoModelForCausalLM.from_pretrained(
            os.path.dirname(os.path.abspath(spec)), gguf_file=os.path.basename(spec), dtype=torch.float32).eval()
    if os.path.isfile(os.path.join(spec, "config.json")):
        return transformers.AutoModelForCausalLM.from_pretrained(spec, dtype=torch.float32).eval()
    return None


def static_generate(model, prompts: list[list[int]], budgets: list[int], batch_size: int, progress=None):
    """Fixed FCFS batches; each runs until its largest budget (left padding for ragged prompts)."""
    import torch

    useful, start = 0, time.perf_counter()
    for i in range(0, len(prompts), batch_size):
        batch, want = prompts[i:i + batch_size], budgets[i:i + batch_size]
        width = max(len(p) for p in batch)
        ids = torch.zeros((len(batch), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, p in enumerate(batch):
            ids[row, width - len(p):] = torch.tensor(p)
            mask[row, width - len(p):] = 1
        longest = max(want)
        with torch.no_grad():
            model.generate(ids, attention_mask=mask, max_new_tokens=longest, min_new_tokens=longest,
                           do_sample=False, pad_token_id=0)
        useful += sum(want)
        if progress is not None:
            progress(len(batch))
    return useful, time.perf_counter() - start


def continuous_generate_batch(model, prompts: list[list[int]], budgets: list[int], max_batch: int,
                              progress=None, return_tokens: bool = False):
    import torch
    from transformers import ContinuousBatchingConfig, GenerationConfig

    gen = GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=0, max_new_tokens=max(budgets))
    cb = ContinuousBatchingConfig(max_requests_per_batch=max_batch)
    model.generate_batch(prompts[:1], generation_config=gen, continuous_batching_config=cb, max_new_tokens=2)
    results = {}
    with torch.no_grad(), model.continuous_batching_context_manager(
            generation_config=gen, continuous_batching_config=cb, block=True, timeout=5) as manager:
        start = time.perf_counter()
        ids = [manager.add_request(p, request_id=f"r{i}", max_new_tokens=m, eos_token_id=-1)
               for i, (p, m) in enumerate(zip(prompts, budgets))]
        while len(results) < len(ids):
            out = manager.get_result(timeout=1)
            if out is not None and out.is_finished():
                results[out.request_id] = list(out.generated_tokens)
                if progress is not None:
                    progress(1)
            elif out is None and not manager.is_running():
                raise RuntimeError("transformers' continuous batching thread stopped")
        elapsed = time.perf_counter() - start
    if return_tokens:
        return [results[i] for i in ids], elapsed
    return int(np.sum([len(results[i]) for i in ids])), elapsed

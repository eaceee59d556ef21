"""The transformers peers the experiments compare against, on the same checkpoint.

- `static_generate`: `model.generate` over fixed batches, each run to its longest
  member (static batching as people do it with transformers);
- `continuous_generate_batch`: transformers' own continuous batching manager.

Both are greedy with EOS ignored, so every request makes exactly its budget; both
return (useful output tokens, seconds).

What is set for them, so their rows are honest: PyTorch uses one intra-op thread per
core and a single inter-op thread (`configure_torch`), and `generate_batch` gets a KV
cache of pages of `page_size` tokens holding exactly the tokens the batch can need
(`peer_cache_config`), instead of its default of most of the free memory.
"""

from __future__ import annotations

import os
import time

import numpy as np


def configure_torch() -> dict:
    """One intra-op thread per core, one inter-op thread; returns what was set."""
    import torch

    threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    torch.set_num_threads(threads)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # only settable before the first parallel work
        pass
    return {"torch_threads": torch.get_num_threads(), "torch_interop_threads": torch.get_num_interop_threads()}


def peer_cache_config(prompts: list[list[int]], budgets: list[int], max_batch: int, page_size: int = 16):
    """transformers' continuous batching with a KV cache sized for `max_batch` of the
    longest requests (in pages of `page_size`), and a per-step token budget of one
    prompt per running request."""
    from transformers import ContinuousBatchingConfig

    longest = max(len(p) + b for p, b in zip(prompts, budgets))
    pages_per_request = -(-longest // page_size)
    return ContinuousBatchingConfig(
        page_size=page_size, num_blocks=max_batch * pages_per_request + 1, max_requests_per_batch=max_batch,
        max_batch_tokens=max(max_batch, max(len(p) for p in prompts) * max_batch))


def load_peer(spec: str):
    """A transformers model for a GGUF file, a Hugging Face directory or the smollm2 preset;
    None for random-init presets (no transformers twin: PyTorch, slow to import, is not even imported)."""
    from cbjax.experimental import PRESETS, smollm2_gguf_path

    if spec == "smollm2-135m":
        spec = smollm2_gguf_path()
    elif spec in PRESETS:
        return None
    try:
        import torch
        import transformers
    except ImportError as e:
        print(f"transformers peers need PyTorch (pip install 'cbjax[peers]'): {e}")
        return None

    configure_torch()
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
    from transformers import GenerationConfig

    gen = GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=0, max_new_tokens=max(budgets))
    cb = peer_cache_config(prompts, budgets, max_batch)
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

"""An engine's decode steps alone, timed: what the CPU benchmarks put against a roofline or a peer."""

from __future__ import annotations

import time


class DecodeTimer:
    """An engine of `batch` slots whose decode is timed: `batch` prompts of `prompt_len` random
    tokens prefilled, then `new_tokens - 1` decode steps (the first token comes from the
    prefill), `decode_steps` a call (whole calls: the steps are rounded down to a multiple of
    it). Built once and timed in every round."""

    def __init__(self, model, batch: int, prompt_len: int, new_tokens: int, cpu_kernels: str = "auto",
                 kv_cache_dtype: str = "float16", decode_steps: int = 1):
        import numpy as np

        from cbjax.experimental import Engine, EngineConfig

        self.model, self.batch, self.decode_steps = model, batch, decode_steps
        self.prompt_len, self.new_tokens = prompt_len, new_tokens
        max_seq_len = 1 << (prompt_len + new_tokens - 1).bit_length()
        self.engine = Engine(model, EngineConfig(num_slots=batch, max_seq_len=max_seq_len, cpu_kernels=cpu_kernels,
                                                 decode_steps=decode_steps, kv_cache_dtype=kv_cache_dtype))
        self.steps = (new_tokens - 1) // decode_steps * decode_steps
        self.rng = np.random.default_rng(batch)
        # One untimed pass first: it compiles (and runs once) the two programs the timed passes
        # use, where `warmup()` would compile every token bucket of the engine.
        self.seconds()

    def seconds(self) -> float:
        """One pass: the decode's seconds."""
        import jax
        import numpy as np

        from cbjax import SamplingParams
        from cbjax.experimental import Row, split_logprobs

        engine, batch = self.engine, self.batch
        sampling = SamplingParams(max_tokens=self.new_tokens, ignore_eos=True)
        engine.reset()
        rows = [Row(s, self.rng.integers(3, self.model.config.vocab_size, self.prompt_len).tolist(), 0, True,
                    sampling) for s in range(batch)]
        for out, _ in engine.run(rows):
            jax.block_until_ready(out)
        decodes = [Row(s, [], 0) for s in range(batch)]  # a decode row reads its slot's token on the device
        t0 = time.perf_counter()
        for _ in range(self.steps // self.decode_steps):
            (out, _), = engine.run(decodes, self.decode_steps)
        tokens = np.asarray(split_logprobs(out)[0])[..., 0]
        seconds = time.perf_counter() - t0
        assert (tokens >= 0).all(), "a sequence stopped early"
        return seconds

    def timed(self, repeats: int = 1) -> dict:
        """The median of `repeats` passes: seconds, ms a step and generated tokens/s."""
        import numpy as np

        seconds = float(np.median([self.seconds() for _ in range(repeats)]))
        return {"decode_s": seconds, "ms_per_step": 1000 * seconds / self.steps,
                "tg_tokens_per_s": self.batch * self.steps / seconds}


def median_row(runs: list[dict]) -> dict:
    """Per key, the median of the rounds' values."""
    import numpy as np

    return {k: float(np.median([r[k] for r in runs])) for k in runs[0]}

"""Launch settings tuned on the device (pallas_kernels/tuning.py, cbjax/runtime/compiled/kernel_tuning.py),
checked on this CPU with a fake timer: the fastest candidate is chosen, written to the cache keyed
by kernel, device kind, JAX version and shape, read back by a second start without timing, timed
again for another device kind; refused candidates are left out; and an engine's programs, traced
after its tuning, run the chosen launches (interpreted here) and give the untuned engine's tokens."""

from __future__ import annotations

import json

import jax
import pytest

from cbjax import LLM, SamplingParams
from cbjax.runtime.compiled import kernel_tuning
from pallas_kernels import decode_matmul, ragged_paged_attention, tuning
from tests.tiers import slow
from tests.internals import engine_of

SHAPE = (16, 4096, 14336, 112, "int8")


class FakeTimer:
    """Scripted seconds by candidate name (unlisted: 1.0), every call counted."""

    def __init__(self, seconds: dict | None = None, run_matching: str | None = None):
        self.seconds, self.run_matching, self.calls = seconds or {}, run_matching, []

    def __call__(self, name, run):
        self.calls.append(name)
        if self.run_matching is not None and self.run_matching in name:
            jax.block_until_ready(run())
        value = self.seconds.get(name, 1.0)
        if isinstance(value, Exception):
            raise value
        return value


@pytest.fixture(autouse=True)
def fresh_choices():
    tuning.forget()
    yield
    tuning.forget()


def candidates(*names):
    return {name: (lambda: None) for name in names}


def test_fastest_is_chosen_written_and_read_back(tmp_path):
    path = tmp_path / "tuning" / tuning.FILE_NAME
    timer = FakeTimer({"a": 3e-3, "b": 1e-3, "c": 2e-3})
    assert tuning.tune("decode_matmul", SHAPE, candidates("a", "b", "c"), cache=tuning.TuningCache(path),
                       device_kind="NVIDIA H200", timer=timer) == "b"
    assert timer.calls == ["a", "b", "c"] and tuning.chosen("decode_matmul", SHAPE) == "b"
    saved = json.loads(path.read_text())
    (key, entry), = saved.items()
    assert key == f"decode_matmul|NVIDIA H200|jax {jax.__version__}|16,4096,14336,112,int8"
    assert entry == {"choice": "b", "sweep": {"a": 3e-3, "b": 1e-3, "c": 2e-3}}

    tuning.forget()
    untimed = FakeTimer({"a": RuntimeError("a second start must not time")})
    assert tuning.tune("decode_matmul", SHAPE, candidates("a", "b", "c"), cache=tuning.TuningCache(path),
                       device_kind="NVIDIA H200", timer=untimed) == "b"
    assert untimed.calls == [] and tuning.chosen("decode_matmul", SHAPE) == "b"

    other = FakeTimer({"a": 1e-3, "b": 2e-3, "c": 2e-3})  # another device: its own sweep, its own entry
    assert tuning.tune("decode_matmul", SHAPE, candidates("a", "b", "c"), cache=tuning.TuningCache(path),
                       device_kind="NVIDIA H100 80GB HBM3", timer=other) == "a"
    assert other.calls == ["a", "b", "c"] and len(json.loads(path.read_text())) == 2
    wider = FakeTimer({"c": 5e-4})  # another shape of the same kernel on the first device: timed
    assert tuning.tune("decode_matmul", (1,) + SHAPE[1:], candidates("a", "b", "c"), cache=tuning.TuningCache(path),
                       device_kind="NVIDIA H200", timer=wider) == "c"
    assert tuning.chosen("decode_matmul", SHAPE) == "a"  # this process's choice: the last tuned for the shape


def test_refused_candidates_are_left_out_and_a_bad_file_is_rewritten(tmp_path):
    path = tmp_path / tuning.FILE_NAME
    path.write_text("{not json")
    timer = FakeTimer({"fast-but-refused": ValueError("too many registers"), "slow": 2.0, "ok": 1.0})
    cache = tuning.TuningCache(path)
    assert tuning.tune("k", (1,), candidates("fast-but-refused", "slow", "ok"), cache=cache, device_kind="d",
                       timer=timer) == "ok"
    entry = json.loads(path.read_text())[cache.key("k", "d", (1,))]
    assert entry["sweep"]["fast-but-refused"].startswith("ValueError: too many registers")
    # A cached choice that is no longer a candidate is timed again.
    assert tuning.tune("k", (1,), candidates("slow", "new"), cache=tuning.TuningCache(path), device_kind="d",
                       timer=FakeTimer({"slow": 2.0, "new": 0.5})) == "new"
    with pytest.raises(ValueError, match="no candidates"):
        tuning.tune("k", (2,), {}, cache=cache, device_kind="d")


def test_time_call_times_the_calls_after_the_first():
    runs = []
    seconds = tuning.time_call(lambda: runs.append(1) or jax.numpy.ones(3), rounds=3, calls=4)
    assert len(runs) == 1 + 3 * 4 and seconds >= 0


MODEL = "tiny-llama"
PROMPTS = [[5, 9, 14, 3, 22, 8, 31], [17, 4, 4, 60, 2, 40, 11, 19, 27, 33, 6, 12, 50]]


@slow
def test_engine_tunes_its_own_kernel_calls_and_runs_the_choices(tmp_path, monkeypatch):
    """Every Pallas call of the engine's programs (the decode matmul on its int8 weights at the
    decode-sized buckets, the attention kernel at every bucket) is tuned; the fake timer prefers
    split-KV at 4 and the matmul's stream form (running those candidates, interpreted); the
    programs traced after (tuning drops those compiled before) use them, and the tokens are
    those the engine gave before its tuning."""
    from pallas_kernels.ragged_paged_attention import triton_kernel

    options = dict(num_slots=4, max_seq_len=64, kv_cache="paged", page_size=16, quantization="int8",
                   quantized_matmul="pallas", attention="pallas", kernel_tuning="off")
    sampling = SamplingParams(max_tokens=6, ignore_eos=True)
    llm = LLM(MODEL, **options)
    want = [o.token_ids for o in llm.generate(PROMPTS, sampling, use_tqdm=False)]  # before tuning: the defaults
    cache = tuning.TuningCache(tmp_path / tuning.FILE_NAME)
    preferred = {}

    def prefer(name):
        return 0.5 if name in ("kv_splits=4", "form=stream") else 1.0 + len(name) * 1e-3

    timer = FakeTimer(run_matching="kv_splits=4")
    timer.seconds = preferred
    calls = kernel_tuning.kernel_calls(engine_of(llm))
    kernels = {kernel for kernel, _ in calls}
    assert kernels == {decode_matmul.KERNEL, ragged_paged_attention.KERNEL}
    assert all(shape[0] <= decode_matmul.MAX_ROWS for kernel, shape in calls if kernel == decode_matmul.KERNEL)
    for kernel, shape in calls:
        names = ([launch.name for launch in decode_matmul.candidates(shape[0], shape[3])] + ["xla"]
                 if kernel == decode_matmul.KERNEL else
                 [launch.name for launch in ragged_paged_attention.candidates_of(shape)])
        preferred.update({name: prefer(name) for name in names})
    choices = kernel_tuning.tune_kernels(engine_of(llm), cache=cache, device_kind="NVIDIA H200", timer=timer,
                                         interpret=True)
    assert set(choices) == set(calls)
    assert {c for (k, _), c in choices.items() if k == ragged_paged_attention.KERNEL} == {"kv_splits=4"}
    # The stream form at one to four rows; past them it is no candidate and XLA's product (the
    # shortest name, so the fastest by this timer) is chosen: the engine sends those back to XLA.
    assert {c for (k, _), c in choices.items() if k == decode_matmul.KERNEL} == {"form=stream", "xla"}
    assert len(json.loads(cache.path.read_text())) == len(calls)

    seen = []
    original = triton_kernel.attention
    monkeypatch.setattr(triton_kernel, "attention", lambda *a, **kw: seen.append(kw["kv_splits"]) or original(*a, **kw))
    got = [o.token_ids for o in llm.generate(PROMPTS, sampling, use_tqdm=False)]
    assert got == want
    assert seen and set(seen) == {4}

    tuning.forget()  # a second start reads every choice and times nothing
    again = FakeTimer({name: RuntimeError("timed on a second start") for name in preferred})
    assert kernel_tuning.tune_kernels(engine_of(llm), cache=tuning.TuningCache(cache.path), device_kind="NVIDIA H200",
                                      timer=again, interpret=True) == choices
    assert again.calls == []


def test_kernel_tuning_knob():
    with pytest.raises(ValueError, match="kernel_tuning must be one of"):
        LLM(MODEL, num_slots=2, max_seq_len=32, kernel_tuning="sometimes")
    llm = LLM(MODEL, num_slots=2, max_seq_len=32)
    assert not kernel_tuning.wanted(engine_of(llm))  # a CPU engine: nothing to tune
    assert llm.engine_info.kernel_launches == ()

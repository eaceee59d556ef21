"""The on-disk store of compiled step programs (cbjax/runtime/compiled/executables.py): a second
engine of the same shapes reads its programs instead of tracing them, with the same tokens;
anything the trace depends on changes the key; a damaged file is compiled again."""

from __future__ import annotations

import jax
import pytest

from cbjax import LLM, SamplingParams, compile_cache
from cbjax.runtime.compiled import executables
from cbjax.runtime.engine import TRACE_COUNTS

PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12] * 20]


def _generate(**options):
    llm = LLM("tiny-llama", num_slots=2, max_seq_len=48, seed=0, **options)
    outputs = llm.generate(PROMPTS, SamplingParams(max_tokens=6, ignore_eos=True), use_tqdm=False)
    return llm, [o.token_ids for o in outputs]


@pytest.fixture
def store(tmp_path, monkeypatch):
    """A store of its own in an empty directory, nothing loaded in this process."""
    monkeypatch.delenv(compile_cache.ENV, raising=False)  # "off" in the caller's shell would turn it off
    previous = jax.config.jax_compilation_cache_dir
    jax.config.update("jax_compilation_cache_dir", str(tmp_path))
    executables.forget()
    yield tmp_path / executables.SUBDIR
    jax.config.update("jax_compilation_cache_dir", previous)
    executables.forget()


def test_a_second_engine_reads_its_programs_and_makes_the_same_tokens(store):
    _, first = _generate()
    files = sorted(store.iterdir())
    assert files, "nothing stored"
    executables.forget()  # as a new process: only the files remain
    before, traces = executables.COUNTS["read"], sum(TRACE_COUNTS.values())
    _, second = _generate()
    assert executables.COUNTS["read"] - before == len(files)
    assert sum(TRACE_COUNTS.values()) == traces, "traced although every program was stored"
    assert second == first



def test_a_new_program_traces_over_what_a_loaded_program_returned(store):
    """A warm start reads some programs and compiles others: the arrays a loaded program
    returns must type-check in the next trace. JAX 0.12's output types carry its `AutoLayout`
    singleton, which a plain pickle duplicated, and a scan over such an array failed ("the
    layouts do not match"): an engine of `decode_steps=3` behind stored prefill programs."""
    add_one = jax.jit(lambda x: x + 1)
    path = store / "add_one"
    executables.store(path, add_one.lower(jax.numpy.zeros((4, 8))).compile())
    loaded = executables.load(path)
    assert loaded is not None
    carried = jax.jit(lambda x: jax.lax.scan(lambda c, _: (c * 2, None), x, None, length=3)[0])
    assert float(carried(loaded(jax.numpy.zeros((4, 8))))[0, 0]) == 8.0

def test_what_the_trace_depends_on_changes_the_key(store, monkeypatch):
    _generate()
    stored = set(store.iterdir())
    executables.forget()
    # another source tree (an edit of cbjax), or a static argument of the step, is another program
    monkeypatch.setattr(executables, "source_digest", lambda: "edited")
    _, tokens = _generate()
    assert set(store.iterdir()) > stored
    executables.forget()
    _, other = _generate(max_logprobs=2)
    assert len(set(store.iterdir())) > len(stored) * 2 - 1
    assert other == tokens  # greedy tokens do not depend on the logprob columns


def test_a_damaged_file_is_compiled_again(store):
    _, first = _generate()
    for path in store.iterdir():
        path.write_bytes(path.read_bytes()[:100])
    executables.forget()
    before = executables.COUNTS["compiled"]
    _, again = _generate()
    assert executables.COUNTS["compiled"] > before
    assert again == first


@pytest.mark.parametrize("word", ["off", "0", "False", "NO", "none"])
def test_the_cache_variable_turns_the_cache_off_with_any_off_word(monkeypatch, word):
    previous = jax.config.jax_compilation_cache_dir, jax.config.jax_enable_compilation_cache
    monkeypatch.setenv(compile_cache.ENV, word)
    try:
        assert compile_cache.enable() is None  # not a directory named "0"
        assert not jax.config.jax_enable_compilation_cache
        assert executables.directory() is None
    finally:
        jax.config.update("jax_compilation_cache_dir", previous[0])
        jax.config.update("jax_enable_compilation_cache", previous[1])

"""The GGUF parser (`cbjax/loading/gguf_file.py`) against the `gguf` package's own reader."""

from __future__ import annotations

import os

import gguf
import numpy as np
import pytest

from cbjax.loading import presets
from cbjax.loading.gguf_file import GGUFFile


def assert_same_as_gguf_reader(path: str) -> None:
    ours, theirs = GGUFFile(path), gguf.GGUFReader(path)
    # (`contents()` flattens an array of arrays: those are checked by value below.)
    expected = {k: f.contents() for k, f in theirs.fields.items() if not k.startswith("GGUF.") and f.types[1:2] != [9]}
    assert ours.fields.keys() == {k for k in theirs.fields if not k.startswith("GGUF.")}
    for key, value in expected.items():
        assert ours.fields[key] == pytest.approx(value) if isinstance(value, float) else ours.fields[key] == value, key
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for a, b in zip(ours.tensors, theirs.tensors):
        assert a.tensor_type == b.tensor_type and a.data.dtype == b.data.dtype and a.data.shape == b.data.shape, a.name
        assert np.array_equal(a.data, b.data), a.name
        assert not a.data.flags.writeable


def write_every_kind(path: str) -> None:
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_uint8("t.u8", 200)
    writer.add_int8("t.i8", -7)
    writer.add_uint16("t.u16", 60000)
    writer.add_int16("t.i16", -3000)
    writer.add_uint32("t.u32", 4_000_000_000)
    writer.add_int32("t.i32", -2_000_000_000)
    writer.add_float32("t.f32", 0.1)
    writer.add_uint64("t.u64", 2**63 + 5)
    writer.add_int64("t.i64", -(2**62))
    writer.add_float64("t.f64", 1e-300)
    writer.add_bool("t.bool", True)
    writer.add_string("t.str", "héllo ✓")
    writer.add_string("t.empty", "")
    writer.add_array("t.strings", ["a", "", "ñ" * 40])
    writer.add_array("t.ints", [1, -2, 3])
    writer.add_array("t.floats", [0.5, -1.25])
    writer.add_array("t.bools", [True, False, True])
    writer.add_array("t.nested", [[1, 2], [3]])
    writer.add_array("t.none", [])
    rng = np.random.default_rng(0)
    writer.add_tensor("f32", rng.normal(size=(3, 5)).astype(np.float32))
    writer.add_tensor("f16", rng.normal(size=(2, 2, 4)).astype(np.float16))
    writer.add_tensor("i32", np.arange(7, dtype=np.int32))
    q = gguf.quants.quantize(rng.normal(size=(4, 64)).astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("q8_0", q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_every_value_and_tensor_kind_reads_as_the_gguf_package_reads_it(tmp_path):
    path = str(tmp_path / "kinds.gguf")
    write_every_kind(path)
    assert_same_as_gguf_reader(path)
    f = GGUFFile(path)
    assert f.get("t.u64") == 2**63 + 5 and f.get("t.nested") == [[1, 2], [3]] and f.get("t.absent", 3) == 3
    assert f.tensors[-1].shape == (4, 64) and f.tensors[-1].data.shape == (4, 68)  # 2 blocks of 34 bytes a row


def test_smollm2_reads_as_the_gguf_package_reads_it():
    try:
        path = presets.smollm2_gguf_path()
    except FileNotFoundError as e:  # pragma: no cover - CI installs it
        pytest.skip(str(e))
    assert_same_as_gguf_reader(path)


def test_a_damaged_file_is_a_clear_error_naming_it(tmp_path):
    good = tmp_path / "kinds.gguf"
    write_every_kind(str(good))
    data = good.read_bytes()
    cuts = [0, 3, 10, 30, 100, len(data) // 2, len(data) - 100]  # the last: in the last tensor's data
    for cut in cuts:
        bad = tmp_path / f"cut{cut}.gguf"
        bad.write_bytes(data[:cut])
        with pytest.raises(ValueError, match=f"cut{cut}.gguf"):
            GGUFFile(str(bad))
    wrong = tmp_path / "wrong.gguf"
    wrong.write_bytes(b"GGML" + data[4:])
    with pytest.raises(ValueError, match="not a GGUF file"):
        GGUFFile(str(wrong))
    version = tmp_path / "version.gguf"
    version.write_bytes(data[:4] + (7).to_bytes(4, "little") + data[8:])
    with pytest.raises(ValueError, match="GGUF version 7"):
        GGUFFile(str(version))


def test_smollm2s_tokenizer_is_the_one_auto_tokenizer_builds(tmp_path, monkeypatch):
    """`load_gguf_tokenizer` asks transformers' tokenizer class directly (no second parse of the
    file): the same tokenizer as `AutoTokenizer.from_pretrained(..., gguf_file=...)`."""
    from transformers import AutoTokenizer

    from cbjax.loading.gguf import load_gguf_tokenizer

    try:
        path = presets.smollm2_gguf_path()
    except FileNotFoundError as e:  # pragma: no cover - CI installs it
        pytest.skip(str(e))
    monkeypatch.setenv("CBJAX_CACHE_DIR", str(tmp_path))  # converted now, not read from a cache
    ours = load_gguf_tokenizer(path)
    auto = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    assert type(ours) is type(auto) and len(ours) == len(auto) and ours.all_special_ids == auto.all_special_ids
    for text in ["Hello world!", "  two spaces\n\ttab", "<|im_start|>user\nhi<|im_end|>", "ünïcödé 日本語 🙂",
                 "don't 123456 x" * 20, ""]:
        assert ours(text)["input_ids"] == auto(text)["input_ids"], text
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert (ours.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            == auto.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
    assert (ours.bos_token, ours.eos_token, ours.pad_token) == (auto.bos_token, auto.eos_token, auto.pad_token)

"""Write a GGUF file's quantized matrices again in another block type (Q8_0, Q4_0, Q4_1), its
metadata and other tensors as they are: a Q8_0 copy of a Q4_1 file, say, without llama.cpp's
`llama-quantize`. Through the `gguf` package's own quantizers (numpy, one tensor at a time)."""

from __future__ import annotations

import numpy as np

from cbjax.models.gguf_blocks import BLOCK_TYPES, check_kind

_KEEP = ("F32", "F16", "BF16")


def requantize_gguf(source: str, target: str, kind: str) -> dict:
    """`source` to `target` with every quantized matrix as `kind` blocks. Returns the tensor
    bytes of both files."""
    import gguf

    check_kind(kind, f"requantize to {kind}")
    reader = gguf.GGUFReader(source)
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(target, arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue  # written by the writer itself
        vtype = field.types[0]
        sub_type = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), vtype, sub_type)
    qtype = getattr(gguf.GGMLQuantizationType, kind)
    before = after = 0
    for t in reader.tensors:
        before += int(t.n_bytes)
        if t.tensor_type.name in _KEEP:
            data, dtype = np.asarray(t.data), t.tensor_type
        else:
            values = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), np.float32)
            try:
                data = gguf.quants.quantize(values, qtype)
            except (NotImplementedError, gguf.quants.QuantError) as e:
                raise ValueError(f"the gguf package cannot write {t.name!r} in {kind} blocks: {e}") from e
            dtype = qtype
        after += data.nbytes
        writer.add_tensor(t.name, data, raw_shape=data.shape, raw_dtype=dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return {"source_tensor_bytes": before, "target_tensor_bytes": after, "kind": kind, "kinds": sorted(BLOCK_TYPES)}

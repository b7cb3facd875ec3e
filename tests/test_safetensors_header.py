"""The header reader: agrees with the safetensors library on valid files, turns every kind of
damage into a finding, and never raises (fuzzed with hypothesis)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.numpy import save_file

from mtpkit.loaders.safetensors_header import MAX_HEADER_BYTES, read_header


def _codes(header) -> set[str]:
    return {f.code for f in header.findings}


def _raw(path: Path, header: object, payload: bytes = b"", length: int | None = None) -> Path:
    blob = json.dumps(header).encode() if not isinstance(header, bytes) else header
    path.write_bytes(struct.pack("<Q", len(blob) if length is None else length) + blob + payload)
    return path


def test_matches_the_safetensors_library(tmp_path):
    arrays = {"a": np.arange(12, dtype=np.float32).reshape(3, 4),
              "b": np.zeros((5,), dtype=np.int64), "empty": np.zeros((0, 3), np.float16)}
    save_file(arrays, tmp_path / "x.safetensors", metadata={"format": "pt"})
    header = read_header(tmp_path / "x.safetensors")
    assert header.findings == []
    assert header.metadata == {"format": "pt"}
    assert {k: (v.dtype, v.shape) for k, v in header.tensors.items()} == {
        "a": ("F32", (3, 4)), "b": ("I64", (5,)), "empty": ("F16", (0, 3))}
    with open(tmp_path / "x.safetensors", "rb") as fh:
        fh.seek(header.tensors["a"].start)
        assert np.frombuffer(fh.read(48), np.float32).tolist() == list(range(12))


def test_oversized_header_is_refused_without_reading_it(tmp_path):
    path = _raw(tmp_path / "x.safetensors", {}, length=MAX_HEADER_BYTES + 1)
    assert _codes(read_header(path)) == {"safetensors.bad_header"}


def test_header_longer_than_file_is_truncation(tmp_path):
    path = _raw(tmp_path / "x.safetensors", b"{}", length=4096)
    assert _codes(read_header(path)) == {"safetensors.truncated"}


def test_tiny_file(tmp_path):
    (tmp_path / "x.safetensors").write_bytes(b"\x01\x02")
    assert _codes(read_header(tmp_path / "x.safetensors")) == {"safetensors.truncated"}


def test_data_past_end_is_truncation(tmp_path):
    path = _raw(tmp_path / "x.safetensors",
                {"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, b"\0" * 8)
    assert _codes(read_header(path)) == {"safetensors.truncated"}


def test_size_not_matching_dtype_and_shape(tmp_path):
    path = _raw(tmp_path / "x.safetensors",
                {"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 12]}}, b"\0" * 12)
    assert _codes(read_header(path)) == {"safetensors.bad_header"}


def test_unknown_dtype_and_bad_entries(tmp_path):
    path = _raw(tmp_path / "x.safetensors", {
        "q": {"dtype": "Q7", "shape": [2], "data_offsets": [0, 2]},
        "neg": {"dtype": "F16", "shape": [-1], "data_offsets": [2, 4]},
        "rev": {"dtype": "F16", "shape": [1], "data_offsets": [6, 4]},
        "__metadata__": {"k": 1},
    }, b"\0" * 8)
    header = read_header(path)
    assert _codes(header) == {"safetensors.dtype_unknown", "safetensors.bad_header"}
    assert header.tensors == {}


def test_overlap_is_found_and_the_overlapping_tensor_dropped(tmp_path):
    path = _raw(tmp_path / "x.safetensors", {
        "a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
        "b": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]},
    }, b"\0" * 16)
    header = read_header(path)
    assert _codes(header) == {"safetensors.overlap"}
    assert set(header.tensors) == {"a"}


def test_sub_byte_dtypes(tmp_path):
    path = _raw(tmp_path / "x.safetensors",
                {"w": {"dtype": "F4", "shape": [8], "data_offsets": [0, 4]}}, b"\0" * 4)
    assert read_header(path).findings == []


entry = st.fixed_dictionaries({
    "dtype": st.sampled_from(["F32", "BF16", "U8", "U32", "F4", "Q7", 3, None]),
    "shape": st.one_of(st.lists(st.integers(-2, 6), max_size=3), st.text(max_size=3)),
    "data_offsets": st.one_of(st.lists(st.integers(-4, 80), min_size=0, max_size=3),
                              st.none()),
})
headers = st.one_of(
    st.dictionaries(st.text(max_size=8), st.one_of(entry, st.integers(), st.text(max_size=4)),
                    max_size=5),
    st.lists(st.integers(), max_size=3), st.text(max_size=20), st.integers(), st.none())


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(header=headers, payload=st.binary(max_size=96), lie=st.one_of(st.none(), st.integers(0, 2**64 - 1)))
def test_fuzzed_headers_yield_findings_never_exceptions(tmp_path, header, payload, lie):
    path = _raw(tmp_path / "f.safetensors", header, payload, length=lie)
    result = read_header(path)
    for info in result.tensors.values():
        assert 0 <= info.start <= info.end <= result.size


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(blob=st.binary(max_size=200))
def test_fuzzed_bytes(tmp_path, blob):
    path = tmp_path / "g.safetensors"
    path.write_bytes(blob)
    read_header(path)


def test_metadata_null_as_mlx_writes_it_is_accepted(tmp_path):
    """mx.save_safetensors without metadata writes `"__metadata__": null`, which safetensors
    and mlx-lm read; it is no finding (issue 48 item 7)."""
    import mlx.core as mx

    path = tmp_path / "x.safetensors"
    mx.save_safetensors(str(path), {"w": mx.ones((2, 3))})
    header = read_header(path)
    assert header.findings == [] and set(header.tensors) == {"w"} and header.metadata == {}


@pytest.mark.parametrize("metadata", [{"k": 1}, {"k": None}, [], "x", 3])
def test_metadata_the_reference_reader_refuses_is_refused(tmp_path, metadata):
    from safetensors import safe_open

    path = _raw(tmp_path / "x.safetensors", {
        "__metadata__": metadata, "w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}},
        b"\0" * 4)
    with pytest.raises(Exception):  # noqa: B017 - the reference reader's own error type
        safe_open(str(path), "np")
    assert _codes(read_header(path)) == {"safetensors.bad_header"}


def test_mlx_written_bundle_without_metadata_passes_doctor(bundle_copy):
    """A whole bundle re-saved by MLX without metadata: doctor and the loaders take it."""
    import mlx.core as mx

    from mtpkit.verify.doctor import report

    path = bundle_copy("llama", None)
    mx.save_safetensors(str(path / "model.safetensors"),
                        dict(mx.load(str(path / "model.safetensors"))))
    doc = report(path)
    assert doc["summary"]["exit_code"] == 0, doc["findings"]

"""Sidecar locations and layouts seen in the wild, and the deep scan's bounded chunks."""

from __future__ import annotations

import json

import numpy as np
import pytest

from fixtures.factory import Sidecar, write_sidecar
from mtpkit import open_bundle
from mtpkit.loaders.safetensors_header import read_header
from mtpkit.loaders.tensor_data import iter_chunks


@pytest.mark.parametrize("experts", ["fused", "numbered"])
@pytest.mark.parametrize("family", ["qwen3_5_moe", "qwen3_next"])
def test_unstacked_moe_sidecars_are_named(bundle_copy, family, experts):
    path = bundle_copy(family, None)
    write_sidecar(path, family, Sidecar(experts=experts))
    view = open_bundle(path)
    assert view.mtp.expert_layout == experts and view.mtp.num_experts == 4
    assert [f.code for f in view.findings] == ["mtp.experts_unstacked"]


def test_hf_checkpoint_keeps_its_experts_unstacked_without_complaint(built):
    view = open_bundle(built("qwen3_next", hf=True))
    assert view.mtp.expert_layout == "numbered" and view.findings == []


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_hf_checkpoints_in_other_dtypes(built, dtype):
    view = open_bundle(built("qwen3_5", hf=True, dtype=dtype))
    want = {"float16": "F16", "float32": "F32"}[dtype]
    assert {i.dtype for i in view.weights.trunk.values()} == {want}
    assert view.findings == []


def test_sidecar_named_by_config_is_found(bundle_copy):
    path = bundle_copy("qwen3_5", Sidecar(policy="layers"))
    (path / "heads").mkdir()
    (path / "mtp.safetensors").rename(path / "heads" / "draft.safetensors")
    config = json.loads((path / "config.json").read_text())
    config["mlx_lm_extra_tensors"] = {"mtp_file": "heads/draft.safetensors"}
    (path / "config.json").write_text(json.dumps(config))
    view = open_bundle(path)
    assert view.weights.sidecar_file == "heads/draft.safetensors"
    assert view.findings == [] and len(view.mtp.tensors) == 29


def test_sidecar_that_mlx_lm_would_glob_is_in_trunk(bundle_copy):
    path = bundle_copy("qwen3_5", Sidecar())
    (path / "mtp.safetensors").rename(path / "model-mtp.safetensors")
    view = open_bundle(path)
    assert view.weights.sidecar_file == "model-mtp.safetensors"
    assert [f.code for f in view.findings] == ["mtp.in_trunk"]


def test_deep_scan_chunks_are_bounded(built):
    path = built("qwen3_5", Sidecar())
    header = read_header(path / "model.safetensors")
    info = max((i for i in header.tensors.values() if i.dtype == "BF16"), key=lambda i: i.nbytes)
    chunks = list(iter_chunks(path, info, chunk_bytes=1000))
    assert max(c.size for c in chunks) <= 500  # bf16: 1000 bytes -> 500 values
    assert sum(c.size for c in chunks) == info.nbytes // 2
    whole = np.concatenate(chunks)
    import mlx.core as mx

    ref = np.array(mx.load(str(path / "model.safetensors"))[info.name].astype(mx.float32))
    assert np.array_equal(whole, ref.reshape(-1))

"""Quantization measured from shapes: every MLX mode and (bits, group) pair MLX itself
produces is recovered, ambiguity is resolved by the true input width, and only then by what
the config declares."""

from __future__ import annotations

import mlx.core as mx
import pytest

from mtpkit.loaders.quant import Module, Quant, candidates_for, measure
from mtpkit.loaders.safetensors_header import TensorInfo

DTYPES = {mx.uint32: "U32", mx.uint8: "U8", mx.bfloat16: "BF16", mx.float16: "F16",
          mx.float32: "F32"}


def _module(path: str, out: int, inp: int, mode: str, bits: int, group: int,
            lead: tuple[int, ...] = ()) -> Module:
    parts = mx.quantize(mx.ones((*lead, out, inp), dtype=mx.bfloat16), group_size=group,
                        bits=bits, mode=mode)
    mod = Module(path)
    for name, arr in zip(("weight", "scales", "biases"), parts, strict=False):
        mod.params[name] = TensorInfo(f"{path}.{name}", "x", DTYPES[arr.dtype],
                                      tuple(arr.shape), 0, arr.nbytes)
    return mod


AFFINE = [(b, g) for b in (2, 3, 4, 5, 6, 8) for g in (32, 64, 128)]


@pytest.mark.parametrize(("bits", "group"), AFFINE)
def test_affine_recovered_with_true_width(bits, group):
    mod = _module("model.layers.0.mlp.up_proj", 128, 384, "affine", bits, group)
    got = measure({mod.path: mod}, {"hidden_size": 384}, {})[mod.path]
    assert got.quant == Quant("affine", bits, group)
    assert got.decided_by == "in_features"


@pytest.mark.parametrize(("mode", "bits", "group"), [("mxfp4", 4, 32), ("nvfp4", 4, 16),
                                                      ("mxfp8", 8, 32)])
def test_scaled_fp_modes_are_unique_from_shapes(mode, bits, group):
    mod = _module("x.q_proj", 64, 256, mode, bits, group)
    assert "biases" not in mod.params
    got = measure({mod.path: mod}, {}, {})[mod.path]
    assert got.quant == Quant(mode, bits, group) and got.decided_by == "shape"


def test_the_classic_ambiguity_and_its_resolution():
    """With the same packed width and group count, bits x group is fixed: 2-bit/g128,
    4-bit/g64 and 8-bit/g32 give identical shapes (for different true input widths)."""
    mod = _module("x.self_attn.o_proj", 64, 512, "affine", 4, 64)
    w, s = mod.params["weight"], mod.params["scales"]
    assert set(candidates_for(w, s, True)) == {Quant("affine", 4, 64), Quant("affine", 8, 32),
                                                Quant("affine", 2, 128)}
    no_width = measure({"x.self_attn.o_proj": mod}, {}, {})["x.self_attn.o_proj"]
    assert no_width.decided_by == "ambiguous"
    claim = {"x.self_attn.o_proj": Quant("affine", 8, 32)}
    declared = measure({"x.self_attn.o_proj": mod}, {}, claim)["x.self_attn.o_proj"]
    assert declared.quant == Quant("affine", 8, 32) and declared.decided_by == "declared"
    truth = measure({"x.self_attn.o_proj": mod}, {"num_attention_heads": 8, "head_dim": 64},
                    {"x.self_attn.o_proj": Quant("affine", 8, 32)})["x.self_attn.o_proj"]
    assert truth.quant == Quant("affine", 4, 64) and truth.decided_by == "in_features"


def test_down_proj_width_comes_from_its_up_proj_sibling_even_for_stacked_experts():
    up = _module("m.switch_mlp.up_proj", 96, 64, "affine", 4, 32, lead=(4,))
    down = _module("m.switch_mlp.down_proj", 64, 96, "affine", 3, 32, lead=(4,))
    got = measure({up.path: up, down.path: down}, {"hidden_size": 64}, {})
    assert got[down.path].quant == Quant("affine", 3, 32)
    assert got[down.path].in_features == 96


def test_mtp_fc_takes_twice_the_hidden_width():
    fc = _module("mtp.fc", 64, 128, "affine", 8, 64)
    assert measure({"mtp.fc": fc}, {"hidden_size": 64}, {})["mtp.fc"].quant == Quant(
        "affine", 8, 64)


def test_width_contradicting_shapes_is_a_problem():
    mod = _module("x.q_proj", 64, 256, "affine", 4, 64)
    got = measure({mod.path: mod}, {"hidden_size": 200}, {})[mod.path]
    assert got.quant is None and "200 inputs" in got.problem

"""MTP norm conventions decided once per head, against the trunk's gains of the same role.

The fixtures draw gains two ways: tiny (1 +- 0.05 absolute, 0 +- 0.05 zero-centred) and with
the statistics of published Qwen3.5/3.6 heads (zero-centred layer norms 0.30-0.39, q/k 0.74,
final ~2.5), where a vector's own mean says nothing about its encoding.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from click.testing import CliRunner

import mtpkit
from fixtures.factory import Sidecar, write_sidecar
from mtpkit import open_bundle
from mtpkit.cli import main
from mtpkit.convert.convert import ConvertOptions, convert
from mtpkit.convert.repair import repair
from mtpkit.loaders.norms import decide, role_offset
from mtpkit.schemas import validate

ABSOLUTE = Sidecar()
DELTA_DECLARED = Sidecar(norms="delta")
DELTA_UNDECLARED = Sidecar(norms="delta", declare_norms=False)
GAINS = ("tiny", "real")
SEVEN = ("mtp.layers.0.input_layernorm.weight", "mtp.layers.0.post_attention_layernorm.weight",
         "mtp.layers.0.self_attn.q_norm.weight", "mtp.layers.0.self_attn.k_norm.weight",
         "mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight", "mtp.norm.weight")


def _codes(path: Path) -> list[str]:
    return [f.code for f in open_bundle(path).findings]


def _sidecar(path: Path) -> dict[str, mx.array]:
    return {k: v.astype(mx.float32) for k, v in mx.load(str(path / "mtp.safetensors")).items()}


def _bf16_close(a: mx.array, b: mx.array) -> bool:
    """Equal within bf16 rounding of values up to ~4 (one ulp at 4 is 2**-5)."""
    return mx.allclose(a, b, atol=2 ** -5, rtol=2 ** -7).item()


@pytest.mark.parametrize("gains", GAINS)
def test_real_gains_defeat_a_per_vector_rule(built: Callable[..., Path], gains: str) -> None:
    """The fixtures really are hard: rounding each zero-centred vector's mean misreads some
    (q/k near 0.74 round to 1, the final norm near 2.6 to 3) — the rule this module replaces."""
    side = _sidecar(built("qwen3_5", DELTA_DECLARED, gains=gains))
    rounded = {k: round(side[k].mean().item()) for k in SEVEN}
    assert (set(rounded.values()) == {0}) == (gains == "tiny"), rounded


@pytest.mark.parametrize("gains", GAINS)
def test_correct_sidecars_are_judged_right(built: Callable[..., Path], gains: str) -> None:
    absolute = open_bundle(built("qwen3_5", ABSOLUTE, gains=gains))
    assert "mtp.norm_encoding" not in _codes(absolute.root)
    assert absolute.mtp.norm_encoding == "absolute"
    roles = {e.role: e.offset for e in absolute.mtp.norms.evidence}
    assert set(roles) == {"input_layernorm", "post_attention_layernorm", "q_norm", "k_norm",
                          "pre_fc_norm_embedding", "pre_fc_norm_hidden", "final_norm"}
    assert set(roles.values()) == {0}
    delta = open_bundle(built("qwen3_5", DELTA_DECLARED, gains=gains))
    assert "mtp.norm_encoding" not in _codes(delta.root)
    assert delta.mtp.norm_encoding == "delta" and delta.mtp.norms.offset == -1


@pytest.mark.parametrize("gains", GAINS)
def test_zero_centred_undeclared_is_found_and_fixed(built: Callable[..., Path], bundle_copy,
                                                    tmp_path: Path, gains: str) -> None:
    path = built("qwen3_5", DELTA_UNDECLARED, gains=gains)
    view = open_bundle(path)
    [hit] = [f for f in view.findings if f.code == "mtp.norm_encoding"]
    assert "zero-centred" in hit.message and "not declared delta" in hit.message and hit.fixable
    assert "q_norm" in hit.message and "final_norm" in hit.message  # the evidence is shown
    result = CliRunner().invoke(main, ["doctor", str(path), "--fix", "--out",
                                       str(tmp_path / "fixed"), "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    validate(doc, "doctor_report")
    assert doc["bundle"]["mtp"]["norm_encoding"] == "absolute" and doc["findings"] == []
    assert {e["offset"] for e in doc["bundle"]["mtp"]["norm_evidence"]} == {0}
    assert doc["repair"]["applied"][0]["code"] == "mtp.norm_encoding"
    fixed, correct = _sidecar(tmp_path / "fixed"), _sidecar(built("qwen3_5", ABSOLUTE, gains=gains))
    assert sorted(fixed) == sorted(correct)
    for name in SEVEN:
        assert _bf16_close(fixed[name], correct[name]), name


@pytest.mark.parametrize("gains", GAINS)
def test_shifted_twice_is_found_and_fixed(bundle_copy, tmp_path: Path, built, gains: str) -> None:
    """Absolute gains declared delta: a runtime would add +1 again."""
    path = bundle_copy("qwen3_5", None, gains=gains)
    write_sidecar(path, "qwen3_5", ABSOLUTE, gains=gains)
    config = json.loads((path / "config.json").read_text())
    config["mtplx_mtp_quantization"]["norm_encoding"] = "delta"
    (path / "config.json").write_text(json.dumps(config))
    [hit] = [f for f in open_bundle(path).findings if f.code == "mtp.norm_encoding"]
    assert "shifted (+1)" in hit.message and "adds +1 again" in hit.message
    repair(path, tmp_path / "fixed")
    assert "mtp.norm_encoding" not in _codes(tmp_path / "fixed")
    correct = _sidecar(built("qwen3_5", ABSOLUTE, gains=gains))
    for name in SEVEN:
        assert _bf16_close(_sidecar(tmp_path / "fixed")[name], correct[name]), name


def test_correct_sidecar_is_left_untouched(built, tmp_path: Path) -> None:
    path = built("qwen3_5", ABSOLUTE, gains="real")
    result = repair(path, tmp_path / "fixed")
    assert not any(a["code"] == "mtp.norm_encoding" for a in result.applied)
    assert (tmp_path / "fixed" / "mtp.safetensors").read_bytes() == \
        (path / "mtp.safetensors").read_bytes()


def test_mixed_real_head_is_repaired_role_by_role(built, bundle_copy, tmp_path: Path) -> None:
    """A converter that shifted only the decoder layer's norms: layer gains absolute, the head's
    own three (pre-fc, final) still zero-centred."""
    from fixtures.breaker import mtp_norm_encoding

    path = bundle_copy("qwen3_5", ABSOLUTE, gains="real")
    mtp_norm_encoding(path, only=("pre_fc_norm_embedding.weight", "pre_fc_norm_hidden.weight",
                                  "mtp.norm.weight"))
    view = open_bundle(path)
    assert view.mtp.norm_encoding == "mixed"
    [hit] = [f for f in view.findings if f.code == "mtp.norm_encoding"]
    assert "mix conventions" in hit.message and hit.fixable
    repair(path, tmp_path / "fixed")
    fixed, correct = _sidecar(tmp_path / "fixed"), _sidecar(built("qwen3_5", ABSOLUTE, gains="real"))
    for name in SEVEN:
        assert _bf16_close(fixed[name], correct[name]), name


@pytest.mark.slow
def test_hf_source_with_real_gains_converts(built, tmp_path: Path) -> None:
    """Hugging Face sources keep +1 by convention; the bundle passes its own check and its
    sidecar gains equal the MLX-built absolute sidecar's."""
    out = convert(str(built("qwen3_5", hf=True, gains="real")), tmp_path / "out",
                  ConvertOptions()).out
    view = open_bundle(out)
    assert view.mtp.norm_encoding == "absolute" and view.errors == []
    ours, correct = _sidecar(out), _sidecar(built("qwen3_5", ABSOLUTE, gains="real"))
    for name in SEVEN:
        assert _bf16_close(ours[name], correct[name]), name


def test_decoder_loads_declared_delta_like_absolute(built) -> None:
    """The decoder's load path applies doctor's decision: real-statistics delta gains declared
    as such get +1 on all seven gains (q/k and final norm included) and draft identically."""
    absolute = mtpkit.load(built("qwen3_5", ABSOLUTE, gains="real"), dtype="float32")
    delta = mtpkit.load(built("qwen3_5", DELTA_DECLARED, gains="real"), dtype="float32")
    prompt = [5, 9, 14, 3, 7, 21, 8]
    a, b = absolute.generate(prompt, 24, depth=3), delta.generate(prompt, 24, depth=3)
    assert a.tokens == b.tokens and a.stats.accepted == b.stats.accepted


def test_role_offset_abstains_unless_one_offset_fits() -> None:
    assert role_offset(0.35, [1.30, 1.38], trunk_level=1) == -1
    assert role_offset(1.34, [1.30, 1.38], trunk_level=1) == 0
    assert role_offset(2.34, [1.30, 1.38], trunk_level=1) == 1
    assert role_offset(1.34, [0.8, 2.2], trunk_level=1) is None  # a trunk range too wide to tell
    assert role_offset(1.8, [1.30, 1.38], trunk_level=1) is None  # between two conventions
    assert role_offset(0.74, [0.74], trunk_level=0) == 0  # Hugging Face: zero-centred trunk


def test_a_tie_leaves_undecided_gains_unfixable() -> None:
    trunk = {"model.layers.0.input_layernorm.weight": 1.3, "model.norm.weight": 3.4,
             "model.layers.0.self_attn.q_norm.weight": 1.74}
    head = {"mtp.layers.0.input_layernorm.weight": 0.3, "mtp.norm.weight": 3.45,
            "mtp.layers.0.self_attn.k_norm.weight": 1.74}  # k_norm: no twin in this trunk
    decision = decide(head, trunk, trunk_level=1)
    assert decision.encoding == "mixed"
    assert decision.offsets["mtp.layers.0.self_attn.k_norm.weight"] is None
    assert decision.shifts(1) is None
    decision = decide({k: v for k, v in head.items() if k != "mtp.norm.weight"}, trunk, 1)
    assert decision.shifts(1) == {"mtp.layers.0.input_layernorm.weight": 1.0,
                                  "mtp.layers.0.self_attn.k_norm.weight": 1.0}
    assert np.isclose(decision.evidence[0].head_mean, 0.3)

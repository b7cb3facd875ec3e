"""Every finding code has a fixture that triggers it: a healthy bundle, one pathology, and
doctor must name exactly that code, with its catalog severity and exit code, and no other code
than the knock-on findings listed for that damage (the JSON report must stay schema-valid)."""

from __future__ import annotations

import pytest

from fixtures.breaker import BREAKERS
from mtpkit.schemas import finding_codes, validate
from mtpkit.verify.doctor import report

# Codes produced by healthy inputs rather than by damage, each with its own test: mtp.absent
# below; mtp.unsupported (a head of a family the decoder cannot run) in test_families_heads.py.
NOT_DAMAGE = {"mtp.absent", "mtp.unsupported"}
# Other codes one piece of damage is known to raise as well (its knock-on findings). Anything
# beyond these fails the test. Several are misleading rather than informative (marked *): a
# cascade doctor could fold into the root finding.
KNOCK_ON = {
    # * no config: nothing declares MTP layers or quantization, every quantized shape ambiguous
    "files.missing_config": {"config.invalid", "quant.config_mismatch", "quant.ambiguous"},
    "files.missing_weights": {"quant.config_mismatch"},  # * "no tensor is quantized"
    "safetensors.bad_header": {"quant.config_mismatch"},  # * the unreadable shard's tensors
    "safetensors.overlap": {"safetensors.bad_header"},
    "mtp.missing": {"mtp.group_mismatch"},  # * declared sidecar quantization vs no tensors
    "mtp.empty": {"mtp.norm_encoding", "weights.zero_scales"},  # zeroed gains and scales
    # the model class knows down_proj's width (128 inputs), which neither candidate fits
    "quant.ambiguous": {"quant.config_mismatch", "quant.unsupported"},
    "weights.unexpected": {"index.tensor_mismatch"},  # the stray shard is not in the index
}
# quant.config_mismatch is an error per module and a warning for a top-level lie (tested below).
SEVERITIES = {"quant.config_mismatch": {"error", "warning"}}


def test_every_catalog_code_has_a_fixture():
    assert set(finding_codes()) - NOT_DAMAGE == set(BREAKERS)


@pytest.mark.parametrize("code", sorted(BREAKERS))
def test_breaker_triggers_its_code(bundle_copy, code):
    breaker, (family, sidecar), deep = BREAKERS[code]
    path = bundle_copy(family, sidecar)
    assert report(path, deep=deep)["summary"]["ok"], "the base must be healthy"
    breaker(path)
    doc = report(path, deep=deep)
    validate(doc, "doctor_report")
    codes = {f["code"] for f in doc["findings"]} - NOT_DAMAGE
    assert code in codes and codes - {code} <= KNOCK_ON.get(code, set()), codes
    catalog = finding_codes()[code]
    for f in (f for f in doc["findings"] if f["code"] == code):
        assert f["message"] and f["hint"] and f["location"]
        assert f["severity"] in SEVERITIES.get(code, {catalog["severity"]}), f
    # an error knock-on (the ambiguous module's bundle does not load) makes it exit 1 too
    errors = catalog["severity"] == "error" or any(f["severity"] == "error"
                                                   for f in doc["findings"])
    assert doc["summary"]["exit_code"] == (1 if errors else 0)


def test_llama_without_head_is_noted_not_failed(built):
    doc = report(built("llama", None))
    assert [f["code"] for f in doc["findings"]] == ["mtp.absent"]
    assert doc["summary"]["exit_code"] == 0


def test_group_mismatch_names_the_measured_truth(bundle_copy):
    breaker, (family, sidecar), _ = BREAKERS["mtp.group_mismatch"]
    path = bundle_copy(family, sidecar)
    breaker(path)
    [hit] = [f for f in report(path)["findings"] if f["code"] == "mtp.group_mismatch"]
    assert "affine 4-bit g64" in hit["message"] and "affine 4-bit g32" in hit["message"]


def test_per_module_lie_is_an_error_top_level_lie_a_warning(bundle_copy):
    breaker, (family, sidecar), _ = BREAKERS["quant.config_mismatch"]
    path = bundle_copy(family, sidecar)
    breaker(path)
    hits = [f for f in report(path)["findings"] if f["code"] == "quant.config_mismatch"]
    assert {f["severity"] for f in hits} == {"error", "warning"}
    [error] = [f for f in hits if f["severity"] == "error"]
    assert "g128" in error["message"] and "1 module" in error["message"]
    [warning] = [f for f in hits if f["severity"] == "warning"]
    assert "g32" in warning["message"]


def test_norms_shifted_twice_are_caught(bundle_copy):
    """A delta declaration on a sidecar whose norms were already shifted: +1 applied twice."""
    import json

    path = bundle_copy("qwen3_5", None)
    from fixtures.factory import Sidecar, write_sidecar

    write_sidecar(path, "qwen3_5", Sidecar(norms="absolute"))
    config = json.loads((path / "config.json").read_text())
    config["mtplx_mtp_quantization"]["norm_encoding"] = "delta"
    (path / "config.json").write_text(json.dumps(config))
    [hit] = [f for f in report(path)["findings"] if f["code"] == "mtp.norm_encoding"]
    assert "shifted (+1)" in hit["message"] and "adds +1 again" in hit["message"]


def test_nan_norms_do_not_crash_the_header_pass(bundle_copy):
    from fixtures.breaker import _poke_first

    path = bundle_copy("qwen3_5", None)
    from fixtures.factory import Sidecar, write_sidecar

    write_sidecar(path, "qwen3_5", Sidecar())
    _poke_first(path, "mtp.safetensors", lambda k, v: k.endswith("norm.weight"), b"\xc0\x7f")
    assert report(path)["summary"]["ok"]
    assert "weights.nonfinite" in {f["code"] for f in report(path, deep=True)["findings"]}

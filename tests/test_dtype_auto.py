"""dtype "auto" (the default of every entry): the bundle's own float dtype, or float32 where a
measured matmul says it is clearly faster (MLX's CPU backend) and the widened weights fit; the
choice is said on stderr, refused values are one line with a code at every entry."""

from __future__ import annotations

import mlx.core as mx
import pytest
from click.testing import CliRunner

from mtpkit.cli import main
from mtpkit.decoder.options import OptionError
from mtpkit.decoder.runner import load, numerics_note
from mtpkit.decoder.tuning import dtypes

CPU = mx.default_device().type == mx.DeviceType.cpu


def _widens() -> bool:
    """What auto must do with a bfloat16 bundle here (the probe is this machine's fact)."""
    return CPU and dtypes._float32_speedup() >= dtypes.CLEARLY


def _weights(dtype: mx.Dtype, n: int = 1000) -> list[mx.array]:
    return [mx.zeros((n,), dtype=dtype), mx.zeros((4,), dtype=mx.uint32)]


def test_auto_widens_a_bfloat16_bundle_where_float32_is_faster(built):
    bundle = built("llama", quantize=False)
    runner = load(bundle)  # the Python API's default is auto too
    weight = runner.trunk.inner.layers[0].mlp.up_proj.weight
    if _widens():
        assert runner.load_options["dtype"] == "float32" and weight.dtype == mx.float32
        assert "dtype float32" in numerics_note(runner) and "--dtype bfloat16" in runner.dtype_note
    else:  # a GPU (or a CPU where bfloat16 is as fast): the bundle's own
        assert runner.load_options["dtype"] is None and weight.dtype == mx.bfloat16
    kept = load(bundle, dtype=None)
    assert kept.load_options["dtype"] is None and kept.dtype_note == ""
    assert kept.trunk.inner.layers[0].mlp.up_proj.weight.dtype == mx.bfloat16


def test_generate_says_which_dtype_it_chose(built):
    bundle = built("llama", quantize=False)
    said = CliRunner().invoke(main, ["generate", str(bundle), "ab", "--raw", "--depth", "0",
                                     "--max-tokens", "2"])
    assert said.exit_code == 0, said.output
    assert ("dtype float32" in said.stderr) == _widens()
    asked = CliRunner().invoke(main, ["generate", str(bundle), "ab", "--raw", "--depth", "0",
                                      "--max-tokens", "2", "--dtype", "bfloat16"])
    assert asked.exit_code == 0 and "dtype float32" not in asked.stderr


def test_auto_keeps_the_bundles_dtype_where_float32_does_not_pay(monkeypatch):
    if not CPU:
        assert dtypes.choose("auto", _weights(mx.bfloat16), False).dtype is None
        return
    monkeypatch.setattr(dtypes, "_float32_speedup", lambda: 1.1)
    slow = dtypes.choose("auto", _weights(mx.bfloat16), False)
    assert slow.dtype is None and "not clearly faster" in slow.reason
    monkeypatch.setattr(dtypes, "_float32_speedup", lambda: 3.0)
    assert dtypes.choose("auto", _weights(mx.bfloat16), False).dtype == "float32"
    monkeypatch.setattr(dtypes, "_physical_memory", lambda: 1000 * 4)  # the widened weights: 4 kB
    full = dtypes.choose("auto", _weights(mx.bfloat16), False)
    assert full.dtype is None and "do not fit" in full.reason


@pytest.mark.parametrize("weights, quantized", [
    (_weights(mx.float32), False),  # already float32: nothing to widen
    (_weights(mx.bfloat16), True),  # --keep-quantized: mlx-lm's numerics, never cast
])
def test_auto_has_nothing_to_do(weights, quantized, monkeypatch):
    monkeypatch.setattr(dtypes, "_float32_speedup", lambda: 3.0)
    assert dtypes.choose("auto", weights, quantized) == dtypes.DtypeChoice(None)


def test_the_probe_is_measured_once_per_machine(monkeypatch, tmp_path):
    monkeypatch.setenv("MTPKIT_CACHE", str(tmp_path))
    times = iter([0.004, 0.001])  # bfloat16 then float32
    monkeypatch.setattr(dtypes, "_time", lambda dtype: next(times))
    assert dtypes._float32_speedup() == pytest.approx(4.0)
    assert dtypes.cache_file().is_file()
    monkeypatch.setattr(dtypes, "_time", lambda dtype: pytest.fail("measured twice"))
    assert dtypes._float32_speedup() == pytest.approx(4.0)


def test_a_dtype_no_entry_takes_is_refused_with_a_code(built):
    with pytest.raises(OptionError) as refused:
        load(built("llama", quantize=False), dtype="float64")
    assert refused.value.code == "options.invalid" and "auto" in str(refused.value)
    said = CliRunner().invoke(main, ["generate", str(built("llama", quantize=False)), "ab",
                                     "--dtype", "float64"])
    assert said.exit_code == 2 and "float64" in said.output and "Traceback" not in said.output

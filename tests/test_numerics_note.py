"""On MLX's CPU backend a quantized bundle runs dequantized (faster there), so its greedy text
can differ from stock mlx-lm's on the same bundle: generate and serve say so where it happens,
and --keep-quantized runs mlx-lm's quantized numerics."""

from __future__ import annotations

import json

import mlx.core as mx
import pytest
from click.testing import CliRunner

from mtpkit.cli import main
from mtpkit.decoder.runner import load, numerics_note

pytestmark = pytest.mark.skipif(mx.default_device().type != mx.DeviceType.cpu,
                                reason="the dequantized default is the CPU backend's")


def _generate(bundle, *options):
    return CliRunner().invoke(main, ["generate", str(bundle), "ab", "--raw", "--depth", "0",
                                     "--max-tokens", "2", *options])


def test_a_dequantized_bundle_says_so(built):
    bundle = built("qwen3_5")
    assert json.loads((bundle / "config.json").read_text()).get("quantization")
    result = _generate(bundle)
    assert result.exit_code == 0, result.output
    assert "runs dequantized" in result.stderr and "--keep-quantized" in result.stderr
    kept = _generate(bundle, "--keep-quantized")
    assert kept.exit_code == 0, kept.output
    assert "runs dequantized" not in kept.stderr
    assert load(bundle, False).load_options["dequantized"] is False


def test_a_float_bundle_in_its_own_dtype_has_nothing_to_say(built):
    runner = load(built("llama", quantize=False), dtype=None)  # (auto's widening: test_dtype_auto)
    assert numerics_note(runner) is None


def test_keeping_and_casting_contradict(built):
    result = _generate(built("qwen3_5"), "--keep-quantized", "--dtype", "float32")
    assert result.exit_code == 2 and "error [usage]" in result.output

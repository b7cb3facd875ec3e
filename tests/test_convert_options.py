"""convert's quantization options as a user types them: every combination MLX cannot quantize is
one line with its code before any work (never mx.quantize's traceback), and quantization options
without -q quantize (and say so) instead of silently writing a float copy."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from mtpkit.cli import main
from mtpkit.convert.quantize import check_quantization, supported
from mtpkit.convert.trunk import QuantOptions
from mtpkit.loaders.findings import UserError


def _run(*args: str):
    return CliRunner().invoke(main, list(args))


@pytest.mark.parametrize("options", [
    ["-q", "--q-bits", "7"],
    ["-q", "--mtp-bits", "7"],
    ["-q", "--quant-override", "*.lm_head=7"],
    ["-q", "--q-mode", "mxfp4", "--q-group-size", "64"],
    ["-q", "--q-group-size", "16"],
    ["--q-bits", "7"],  # implied -q, still refused
], ids=lambda o: " ".join(o))
def test_quantization_mlx_cannot_do_is_one_line(built, tmp_path, options):
    out = tmp_path / "out"
    result = _run("convert", str(built("qwen3_5", hf=True)), str(out), *options)
    assert result.exit_code == 2, result.output
    assert "error [quant.unsupported]" in result.output and "hint:" in result.output
    assert "Traceback" not in result.output and not out.exists()
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("option, bits", [
    (["--q-bits", "4"], 4),  # the input: it wrote an unquantized copy, silently
    (["--q-bits", "8"], 8),
    (["--q-group-size", "32"], 4),
    (["--quant-override", "*.mlp.*=8"], 4),
])
def test_quant_options_without_q_quantize_and_say_so(built, tmp_path, option, bits):
    out = tmp_path / "out"
    result = _run("convert", str(built("qwen3_5", hf=True)), str(out), *option)
    assert result.exit_code == 0, result.output
    assert "quantizing the trunk (as -q)" in result.output
    config = json.loads((out / "config.json").read_text())
    assert config["quantization"]["bits"] == bits


def test_the_answer_is_mlx_own():
    """The supported set is mx.quantize's: affine takes 4-bit/g64 but not 7 bits or group 16;
    the float modes take exactly their one shape."""
    assert supported(4, 64, "affine") and supported(8, 32, "affine")
    assert not supported(7, 64, "affine") and not supported(4, 16, "affine")
    assert supported(4, 32, "mxfp4") and not supported(4, 64, "mxfp4")
    assert supported(4, 16, "nvfp4") and supported(8, 32, "mxfp8")
    with pytest.raises(UserError, match="7-bit") as caught:
        check_quantization(7, None, "affine", "trunk")
    assert caught.value.code == "quant.unsupported" and "32/64/128" in caught.value.hint
    with pytest.raises(UserError):
        QuantOptions(quantize=True, mode="mxfp4", group_size=64)
    assert QuantOptions(bits=4).implied and not QuantOptions(quantize=True).implied

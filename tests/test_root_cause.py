"""A cut shard is one finding, not hundreds: doctor reports each damaged file once with its
count, folds the quantized modules it left incomplete under it, and every entry point that
refuses the bundle names that root cause (not `quant.incomplete`, its consequence)."""

from __future__ import annotations

import os

import pytest
from click.testing import CliRunner

from fixtures.breaker import DENSE
from mtpkit.cli import main
from mtpkit.verify.doctor import report


@pytest.fixture
def cut(bundle_copy):
    """A quantized trunk shard cut in half, as an interrupted download leaves it."""
    path = bundle_copy(*DENSE)
    shard = path / "model.safetensors"
    os.truncate(shard, shard.stat().st_size // 2)
    return path


def test_a_cut_shard_is_one_finding_with_its_count(cut):
    doc = report(cut)
    codes = [f["code"] for f in doc["findings"]]
    assert codes == ["safetensors.truncated"], codes
    (root,) = doc["findings"]
    assert root["location"] == "model.safetensors"
    assert "tensor(s) run past the end of the file" in root["message"]
    assert "quantized module(s) left incomplete by it" in root["message"]


@pytest.mark.parametrize("command", [["generate", "{b}", "hi", "--max-tokens", "1"],
                                     ["convert", "{b}", "{out}"],
                                     ["graft", "{b}", "--out", "{out}", "--force"],
                                     ["serve", "{b}", "--port", "0"],
                                     ["tune", "{b}"],
                                     ["verify-run", "{b}", "--loads", "code"]])
def test_every_entry_names_the_root_cause(cut, tmp_path, command):
    args = [a.format(b=cut, out=tmp_path / "out") for a in command]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2, result.output
    assert "error [safetensors.truncated]" in result.output, result.output
    assert "quant.incomplete" not in result.output

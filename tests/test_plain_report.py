"""An answer `--depth auto` decoded entirely plain reports what happened: no draft position was
verified (drafted_depth 0), no acceptance for positions never drafted (it said eight 0.0s) and no
predicted speedup (it said 0.857x) — in the generation's stats, `--json` and serve's usage."""

from __future__ import annotations

import pytest

import mtpkit
from mtpkit.decoder.stats import Stats
from mtpkit.decoder.tuning.curve import CostCurve
from mtpkit.schemas import validate
from mtpkit.serve.service import usage


@pytest.fixture
def plain_auto(built):
    """A runner whose (hand-given) costs make every round dearer than plain steps."""
    runner = mtpkit.load(built("qwen3_5"), dtype="float32")
    runner._costs = CostCurve([10.0 * t for t in range(1, 17)], plain=1.0, draft=5.0)
    return runner


def test_auto_decoded_plain_reports_no_acceptance(plain_auto):
    result = plain_auto.generate([1, 2, 3, 4], max_tokens=12, depth="auto")
    stats = result.stats.to_dict()
    assert set(stats["depths"]) == {"0"}  # every step plain
    assert stats["verify_calls"] == 0 and stats["depth"] > 0
    assert stats["drafted_depth"] == 0 and stats["acceptance_by_depth"] == []
    assert stats["predicted_speedup"] is None
    mtp = usage(result, "head")["mtp"]
    assert mtp["drafted_depth"] == 0 and mtp["acceptance_by_depth"] == []
    assert mtp["predicted_speedup"] is None


def test_positions_never_drafted_have_no_entry():
    stats = Stats(depth=8)
    stats.count_round("head", 2, kept=1, bonus=False)
    stats.count_round("head", 1, kept=1, bonus=True)
    assert stats.acceptance_by_depth == [1.0, 0.0] and stats.drafted_depth == 2
    doc = stats.to_dict()
    assert doc["sources"]["head"]["acceptance_by_depth"] == [1.0, 0.0]
    validate({"bundle": "b", "text": "", "tokens": [], "finish_reason": "length",
              "stats": {**doc, "prompt_tokens": 1}}, "generation")


def test_a_drafting_run_reports_every_position_it_drafted(built):
    runner = mtpkit.load(built("qwen3_5"), dtype="float32")
    stats = runner.generate([1, 2, 3, 4], max_tokens=12, depth=3).stats
    assert stats.verify_calls > 0 and stats.drafted_depth == 3
    assert len(stats.acceptance_by_depth) == 3

"""The `edit` load: a held-out module, then its start again for the model to continue."""

from __future__ import annotations

import random

from mtpkit.train.corpus import held_out_documents
from mtpkit.verify.loads import LOADS, real_loads


def test_edit_load_repeats_the_start_of_a_held_out_module() -> None:
    load = real_loads(["edit"])["edit"]
    assert "edit" in LOADS and not load.chat
    name, _, rest = load.text.removeprefix("# ").partition(" (before)\n")
    source, after = rest.split(f"\n\n# {name} (after)\n")
    doc = next(d for d in held_out_documents() if d.name.endswith("/" + name))
    assert 1500 <= len(source) <= 2500 and doc.text.startswith(source)
    assert len(after) >= 300 and source.startswith(after)  # the second copy: a prefix of the first
    assert load.text.count(after) == 2 and load.text.endswith(after)


def test_edit_load_is_deterministic_and_fresh_adds_a_nonce() -> None:
    load = real_loads(["edit"])["edit"]
    assert real_loads(["edit"])["edit"] == load
    fresh = load.fresh(random.Random(0))
    assert fresh != load.text and fresh.endswith(load.text) and fresh.startswith("[request ")
    assert fresh == load.fresh(random.Random(0)) != load.fresh()

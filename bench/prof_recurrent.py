"""What a hybrid trunk's verify round costs for its recurrent layers, per width T: the pass
alone, the pass recording, and recording plus a commit that keeps 1 position (the replay) or
all T (nothing to replay), on a Qwen3.5-shaped 4-bit trunk with random weights at a context.

Runs against whatever `mtpkit` is first on the path, so an older tree can be timed the same
way (`PYTHONPATH=/tmp/old`: `git archive REV | tar x -C /tmp/old/mtpkit`).

    .venv/bin/python bench/prof_recurrent.py --scale 4 --context 512 --repeats 7
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import save  # noqa: E402


def trunk_of(scale: int, layers: int):
    from bench_gpu import oracle_ready
    from mlx_lm.models.qwen3_5 import Model, ModelArgs

    from mtpkit.decoder.model.trunk import Trunk

    text = {"model_type": "qwen3_5_text", "hidden_size": 4096 // scale,
            "num_hidden_layers": layers, "intermediate_size": 12288 // scale,
            "num_attention_heads": max(1, 16 // scale), "num_key_value_heads": max(1, 4 // scale),
            "head_dim": 256, "linear_num_key_heads": max(1, 16 // scale),
            "linear_num_value_heads": max(1, 32 // scale), "linear_key_head_dim": 128,
            "linear_value_head_dim": 128, "full_attention_interval": 4,
            "vocab_size": 248320 // scale, "rms_norm_eps": 1e-6, "tie_word_embeddings": False}
    return Trunk(oracle_ready(Model, ModelArgs(model_type="qwen3_5", text_config=text), 4))


def main() -> None:
    import mlx.core as mx

    from mtpkit.decoder.cache.caches import snapshot
    from mtpkit.decoder.cache.state import commit_recorded, rewind

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scale", type=int, default=4, help="divide the 9B's widths by this")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--widths", default="1,2,3,4")
    ap.add_argument("--traced", action="store_true", help="traced passes (a GPU's default)")
    ap.add_argument("--tag", default="recurrent")
    args = ap.parse_args()
    trunk = trunk_of(args.scale, args.layers)
    trunk.use_traced(args.traced)
    cache = trunk.make_cache(bounded=args.traced)
    mx.eval(trunk(mx.arange(args.context)[None] % 1000, cache)[1])

    def timed(width: int, record: bool, keep: int | None) -> float:
        saved = snapshot(cache)
        tokens = mx.arange(width)[None] + 7
        start = time.perf_counter()
        _, logits = trunk(tokens, cache, record=record)
        if keep is not None:
            commit_recorded(cache, trunk.recorders, width, keep)
        mx.eval(logits, [c.state for c in cache])
        took = time.perf_counter() - start
        rewind(cache, saved, width if keep is None else keep, 0)
        return took

    arms = {"pass": (False, None), "record": (True, None), "keep 1": (True, 1),
            "keep all": (True, -1)}
    out: dict = {"args": vars(args), "ms": {}}
    for width in [int(w) for w in args.widths.split(",")]:
        row = {}
        for name, (record, keep) in arms.items():
            k = None if keep is None else (width if keep == -1 else keep)
            runs = [timed(width, record, k) for _ in range(args.repeats + 1)][1:]
            row[name] = round(1000 * statistics.median(runs), 2)
        out["ms"][width] = row
        print(f"T={width}", row, flush=True)
    print(f"saved {save(args.tag, out)}")


if __name__ == "__main__":
    main()

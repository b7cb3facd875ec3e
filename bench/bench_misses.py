"""What a grafted head's depth-1 drafts miss on the held-out loads (decoder/drafters/misses.py): rounds a
3-token lookup in the context would have drafted right, targets outside the draft vocabulary,
the rest. Greedy, the same seeded nonces as bench_decode.py --nonce-seed.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libopenblas.so.0 .venv/bin/python \
        bench/bench_misses.py --bundle GRAFTED --runs 8 --nonce-seed 1
"""

from __future__ import annotations

import argparse
import random
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_decode import load_ids  # noqa: E402
from common import save  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bundle", type=Path, required=True, help="a bundle with an MTP head")
    ap.add_argument("--runs", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=192)
    ap.add_argument("--loads", default="held_code,held_memo")
    ap.add_argument("--nonce-seed", type=int, default=1)
    ap.add_argument("--tag", default="misses")
    args = ap.parse_args()

    import mtpkit
    from mtpkit.decoder.drafters.misses import classify
    from mtpkit.verify.loads import real_loads

    runner = mtpkit.load(args.bundle, dtype="float32")
    if runner.head is None:
        sys.exit(f"error: {args.bundle} has no MTP head")
    vocab = getattr(runner.head, "draft_vocab", None)
    vocab = set(vocab.tolist()) if vocab is not None else None
    results = {}
    for name, load in real_loads(args.loads.split(",")).items():
        rng = random.Random(args.nonce_seed)
        counts: Counter[str] = Counter()
        for _ in range(args.runs):
            ids = load_ids(runner, load, load.fresh(rng))
            seq, rounds = list(ids), []
            for n, piece in enumerate(runner.stream(ids, args.max_tokens, depth=1)):
                # the first piece is the prefill's token and the last token has no draft
                if n > 0 and len(seq) - len(ids) < args.max_tokens - 1 and piece.tokens:
                    rounds.append((len(seq), len(piece.tokens) == 2))
                seq += piece.tokens
                if piece.result is not None and piece.result.finish_reason == "stop":
                    rounds = rounds[:-1]  # a round cut at the end of text may hide its bonus
            counts += classify(seq, rounds, vocab)
        total = sum(counts.values())
        share = {k: round(v / total, 4) for k, v in sorted(counts.items())}
        results[name] = {"rounds": total, "counts": dict(counts), "share": share}
        print(name, total, "rounds", share, flush=True)
    save(args.tag, {"bundle": str(args.bundle), "runs": args.runs,
                    "max_tokens": args.max_tokens, "nonce_seed": args.nonce_seed,
                    "loads": results})


if __name__ == "__main__":
    main()

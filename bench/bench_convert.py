"""Convert streams tensor by tensor: wall time and peak RSS against stock mlx_lm.convert.

Generates bf16 Qwen3.5-MoE-shaped Hugging Face checkpoints (fused experts, zero-centred norms,
HF conv layout, MTP head, shards of at most 2 GiB, real bytes on disk) at two sizes and
converts each with `mtpkit convert -q` and `mlx_lm.convert(quantize=True)` (4-bit, group 64,
the same settings), alternating, each run in a fresh process that reports its own peak RSS.

    .venv/bin/python bench/bench_convert.py [--workdir DIR] [--runs N] [--sizes large,small]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from common import run_isolated, save, summary, write_safetensors  # noqa: E402

SIZES = {  # layers at hidden 2048, 32 experts of width 512: ~0.21 GB of bf16 per layer
    "large": 16,
    "small": 4,  # the last layer must be a full-attention one (the MTP layer copies it)
}
SHARD_BYTES = 2 << 30


def _config(layers: int) -> dict:
    from fixtures.configs import config_for

    cfg = config_for("qwen3_5_moe")
    cfg["text_config"].update(
        hidden_size=2048, num_hidden_layers=layers, num_attention_heads=16,
        num_key_value_heads=2, head_dim=128, linear_num_value_heads=16,
        linear_num_key_heads=8, linear_key_head_dim=128, linear_value_head_dim=128,
        full_attention_interval=4, num_experts=32, num_experts_per_tok=4,
        moe_intermediate_size=512, shared_expert_intermediate_size=512, vocab_size=32768,
        intermediate_size=1024)
    return cfg


def hf_shapes(cfg: dict) -> dict[str, tuple[tuple[int, ...], str]]:
    """Hugging Face names and shapes of the model (+ its MTP layer), from mlx-lm's classes."""
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes

    model_cls, args_cls = _get_classes(cfg)
    params = {k: tuple(v.shape) for k, v in tree_flatten(model_cls(args_cls.from_dict(cfg))
                                                         .parameters())}
    layers = cfg["text_config"]["num_hidden_layers"]
    last = f"language_model.model.layers.{layers - 1}."
    h = cfg["text_config"]["hidden_size"]
    params |= {"mtp.layers.0." + k[len(last):]: s for k, s in params.items() if k.startswith(last)}
    params |= {"mtp.fc.weight": (h, 2 * h), "mtp.norm.weight": (h,),
               "mtp.pre_fc_norm_embedding.weight": (h,), "mtp.pre_fc_norm_hidden.weight": (h,)}
    out: dict[str, tuple[tuple[int, ...], str]] = {}
    for name, shape in params.items():
        name = (name.replace("language_model.model.", "model.language_model.")
                .replace("language_model.lm_head.", "lm_head."))
        if name.endswith("conv1d.weight"):
            shape = (shape[0], shape[2], shape[1])
        if ".switch_mlp.gate_proj." in name:
            e, i, hh = shape
            out[name.split(".switch_mlp.")[0] + ".experts.gate_up_proj"] = ((e, 2 * i, hh),
                                                                            "bfloat16")
            continue
        if ".switch_mlp.up_proj." in name:
            continue
        if ".switch_mlp.down_proj." in name:
            out[name.split(".switch_mlp.")[0] + ".experts.down_proj"] = (shape, "bfloat16")
            continue
        out[name] = (shape, "bfloat16")
    return out


def build(layers: int, out: Path) -> dict:
    from fixtures.tokenizer import write_tokenizer

    cfg = _config(layers)
    shapes = hf_shapes(cfg)
    rng = np.random.default_rng(0)
    normal = (rng.normal(0, 0.02, 1 << 19).astype(np.float32).view(np.uint32) >> 16)
    block = normal.astype(np.uint16).tobytes()  # 1 MiB of valid bf16 values
    out.mkdir(parents=True)
    shards: list[dict] = [{}]
    used = 0
    for name, (shape, dtype) in sorted(shapes.items()):
        n = int(np.prod(shape)) * 2
        if used + n > SHARD_BYTES and shards[-1]:
            shards.append({})
            used = 0
        shards[-1][name] = (shape, dtype)
        used += n
    weight_map, total = {}, 0
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        total += write_safetensors(out / fname, shard, block, {"format": "pt"})
        weight_map.update(dict.fromkeys(shard, fname))
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}))
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    write_tokenizer(out, 512, thinking=True)
    largest = max(p.stat().st_size for p in out.glob("*.safetensors"))
    return {"layers": layers, "bytes": total, "shards": len(shards), "largest_shard": largest,
            "tensors": len(shapes)}


# Both snippets import everything before the clock starts; wall_with_startup_s includes it.
MTPKIT = """
import time
from pathlib import Path
import mlx_lm.convert, mlx_lm.utils  # noqa: F401  (mtpkit imports them lazily)
from mtpkit.convert.convert import ConvertOptions, convert
from mtpkit.convert.trunk import QuantOptions
t = time.perf_counter()
r = convert({src!r}, Path({out!r}), ConvertOptions(quant=QuantOptions(quantize=True)))
RESULT = {{"seconds": time.perf_counter() - t,
          "errors": [f.code for f in r.findings if f.severity == "error"]}}
"""
MLX_LM = """
import time, contextlib, io
from mlx_lm.convert import convert
t = time.perf_counter()
with contextlib.redirect_stdout(io.StringIO()):
    convert({src!r}, {out!r}, quantize=True, q_bits=4, q_group_size=64)
RESULT = {{"seconds": time.perf_counter() - t}}
"""


def _out_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.glob("*.safetensors"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--workdir", type=Path)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--sizes", default="large,small")
    args = parser.parse_args()
    work = args.workdir or Path(tempfile.mkdtemp(prefix="mtpkit-convert-"))
    env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    results: dict = {"runs": args.runs, "sizes": {}}
    try:
        for size in args.sizes.split(","):
            src = work / f"{size}-hf"
            info = build(SIZES[size], src) if not src.exists() else {}
            print(f"[{size}] source {info}", file=sys.stderr)
            for p in sorted(src.glob("*.safetensors")):  # same warm page cache for both tools
                with open(p, "rb") as fh:
                    while fh.read(64 << 20):
                        pass
            rows: dict[str, list[dict]] = {"mtpkit": [], "mlx_lm": []}
            for run in range(args.runs):
                for tool, code in (("mlx_lm", MLX_LM), ("mtpkit", MTPKIT)):
                    out = work / f"{size}-{tool}-{run}"
                    shutil.rmtree(out, ignore_errors=True)
                    wall = time.perf_counter()
                    res = run_isolated(code.format(src=str(src), out=str(out)), env)
                    res["wall_with_startup_s"] = time.perf_counter() - wall
                    res["output_bytes"] = _out_bytes(out)
                    rows[tool].append(res)
                    print(f"[{size}] {tool} run {run}: {res}", file=sys.stderr)
                    shutil.rmtree(out, ignore_errors=True)
            row = {"source": info}
            for tool, runs in rows.items():
                row[tool] = {"seconds": summary([r["seconds"] for r in runs]),
                             "peak_rss_mb": summary([r["peak_rss_mb"] for r in runs]),
                             "output_bytes": runs[-1]["output_bytes"]}
            row["time_ratio"] = row["mtpkit"]["seconds"]["median"] / row["mlx_lm"]["seconds"]["median"]
            row["rss_ratio"] = (row["mtpkit"]["peak_rss_mb"]["median"]
                                / row["mlx_lm"]["peak_rss_mb"]["median"])
            if info:
                bound = (info["largest_shard"] + (1 << 30)) / (1 << 20)
                row["rss_bound_mb"] = bound
                row["within_bound"] = row["mtpkit"]["peak_rss_mb"]["median"] <= bound
            results["sizes"][size] = row
            print(json.dumps({k: v for k, v in row.items() if k != "source"}, indent=1),
                  file=sys.stderr)
        print("saved", save("convert", results))
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

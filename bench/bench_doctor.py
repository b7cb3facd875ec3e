"""Doctor is header-only: its time must not grow with the weight bytes.

Builds two Qwen3.5-MoE-shaped bundles with the same ~3000+ tensors (4-bit trunk in shards of
at most 1 GiB + index, an MTP sidecar), one with ~2 GB of weights and one with ~20 MB, with
real (non-sparse) bytes on disk. Times `doctor` (warm, in one process, and cold via the CLI)
and stock `mlx_lm.load(..., lazy=True)` on each, in isolated processes, and records peak RSS.

    .venv/bin/python bench/bench_doctor.py [--workdir DIR] [--runs N]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from common import run_isolated, save, summary, write_safetensors  # noqa: E402

SHAPES = {  # same layer count (tensor count), different widths
    "small": {"hidden_size": 128, "num_experts": 8, "moe_intermediate_size": 128,
              "shared_expert_intermediate_size": 128, "intermediate_size": 256},
    "large": {"hidden_size": 1024, "num_experts": 28, "moe_intermediate_size": 512,
              "shared_expert_intermediate_size": 512, "intermediate_size": 1024},
}
LAYERS = 72
SHARD_BYTES = 1 << 30


def _config(size: str) -> dict:
    from fixtures.configs import config_for

    cfg = config_for("qwen3_5_moe")
    text = cfg["text_config"]
    text.update(SHAPES[size], num_hidden_layers=LAYERS, num_attention_heads=8,
                num_key_value_heads=2, head_dim=128 if size == "large" else 32,
                linear_num_value_heads=8 if size == "large" else 2,
                linear_num_key_heads=4 if size == "large" else 1,
                linear_key_head_dim=128 if size == "large" else 32,
                linear_value_head_dim=128 if size == "large" else 32, vocab_size=32768)
    return cfg


def _shapes(cfg: dict) -> dict[str, tuple[tuple[int, ...], str]]:
    """Parameter shapes/dtypes of the 4-bit model exactly as mlx-lm would save it (lazy: no
    weights are computed)."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes

    model_cls, args_cls = _get_classes(cfg)
    model = model_cls(args_cls.from_dict(cfg))
    model.set_dtype(mx.bfloat16)
    pred = model.quant_predicate

    def predicate(path, module):
        if not hasattr(module, "to_quantized") or module.weight.shape[-1] % 64:
            return False
        return pred(path, module) if pred else True

    nn.quantize(model, group_size=64, bits=4, class_predicate=predicate)
    return {k: (tuple(v.shape), str(v.dtype).split(".")[-1])
            for k, v in tree_flatten(model.parameters())}


def build(size: str, out: Path) -> dict:
    import numpy as np

    from fixtures.tokenizer import write_tokenizer

    cfg = _config(size)
    shapes = _shapes(cfg)
    rng = np.random.default_rng(0)
    block = rng.integers(0, 256, 1 << 20, dtype=np.uint8).tobytes()
    out.mkdir(parents=True)
    shards: list[dict] = [{}]
    used = 0
    for name, (shape, dtype) in sorted(shapes.items()):
        n = int(np.prod(shape)) * {"uint32": 4, "bfloat16": 2, "float32": 4, "uint8": 1}[dtype]
        if used + n > SHARD_BYTES and shards[-1]:
            shards.append({})
            used = 0
        shards[-1][name] = (shape, dtype)
        used += n
    total, weight_map = 0, {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        total += write_safetensors(out / fname, shard, block, {"format": "mlx"})
        weight_map.update(dict.fromkeys(shard, fname))
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}))
    last = f"layers.{LAYERS - 1}."  # a full-attention layer: the MTP layer's kind
    mtp = {"mtp.layers.0." + k.split(last, 1)[1]: v for k, v in shapes.items() if last in k}
    h = cfg["text_config"]["hidden_size"]
    mtp |= {"mtp.fc.weight": ((h, 2 * h), "bfloat16"), "mtp.norm.weight": ((h,), "bfloat16"),
            "mtp.pre_fc_norm_embedding.weight": ((h,), "bfloat16"),
            "mtp.pre_fc_norm_hidden.weight": ((h,), "bfloat16")}
    write_safetensors(out / "mtp.safetensors", mtp, block, {"format": "mlx"})
    quant = {"group_size": 64, "bits": 4, "mode": "affine"}
    for k in [*shapes, *mtp]:
        if k.endswith((".mlp.gate.scales", "shared_expert_gate.scales")):
            quant[k.rsplit(".", 1)[0]] = {"group_size": 64, "bits": 8}
    cfg["quantization"] = cfg["quantization_config"] = quant
    cfg["mtplx_mtp_quantization"] = {"policy": "layers", "bits": 4, "group_size": 64,
                                     "mode": "affine", "norm_encoding": "absolute"}
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    write_tokenizer(out, 512, thinking=True)
    weights = sum(p.stat().st_size for p in out.glob("*.safetensors"))
    return {"tensors": len(shapes) + len(mtp), "weight_bytes": weights, "shards": len(shards)}


DOCTOR = """
import time, json
from mtpkit.verify.doctor import report
p = {path!r}
report(p)  # warm-up
samples = []
for _ in range({runs}):
    t = time.perf_counter(); doc = report(p); samples.append(time.perf_counter() - t)
RESULT = {{"samples": samples, "errors": doc["summary"]["errors"],
          "codes": sorted({{f["code"] for f in doc["findings"]}})}}
"""
MLX_LOAD = """
import time
import mlx_lm
p = {path!r}
samples = []
for _ in range({runs}):
    t = time.perf_counter(); mlx_lm.load(p, lazy=True); samples.append(time.perf_counter() - t)
RESULT = {{"samples": samples}}
"""
CLI = """
import subprocess, sys, time, os
exe = os.path.join(os.path.dirname(sys.executable), "mtpkit")
samples = []
for _ in range({runs}):
    t = time.perf_counter()
    subprocess.run([exe, "doctor", {path!r}, "--json"], capture_output=True)
    samples.append(time.perf_counter() - t)
import resource
RESULT = {{"samples": samples,
          "cli_peak_rss_mb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024}}
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--runs", type=int, default=7)
    args = parser.parse_args()
    work = args.workdir or Path(tempfile.mkdtemp(prefix="mtpkit-bench-"))
    env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    results: dict = {"layers": LAYERS, "runs": args.runs, "bundles": {}}
    try:
        for size in ("small", "large"):
            path = work / size
            t = time.perf_counter()
            info = build(size, path) if not path.exists() else {}
            info["build_s"] = time.perf_counter() - t
            print(f"[{size}] built {info}", file=sys.stderr)
            row = {"bundle": info}
            for label, code, runs in (("doctor", DOCTOR, args.runs),
                                      ("doctor_cli", CLI, max(3, args.runs // 2)),
                                      ("mlx_lm_load_lazy", MLX_LOAD, max(3, args.runs // 2))):
                res = run_isolated(code.format(path=str(path), runs=runs), env)
                row[label] = {**summary(res.pop("samples")), **res}
                print(f"[{size}] {label}: {row[label]}", file=sys.stderr)
            results["bundles"][size] = row
        small, large = results["bundles"]["small"], results["bundles"]["large"]
        results["ratio_large_over_small"] = {
            k: large[k]["median"] / small[k]["median"]
            for k in ("doctor", "doctor_cli", "mlx_lm_load_lazy")}
        results["doctor_vs_mlx_lm_load"] = {
            s: results["bundles"][s]["doctor"]["median"]
            / results["bundles"][s]["mlx_lm_load_lazy"]["median"] for s in ("small", "large")}
        print(json.dumps(results["ratio_large_over_small"], indent=2))
        print("saved", save("doctor", results))
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

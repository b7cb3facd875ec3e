#!/usr/bin/env bash
# The GPU benchmark of issue 19, on a machine set up as ../shared/reference/gpu.md says (after
# `source /root/gpu-env.sh`), from the project root. Results: bench/results/gpu-*.json.
#   bash bench/gpu.sh mechanics          # c(T) before/after (8B 4-bit, 8B bf16), oracle (~4 min)
#   bash bench/gpu.sh smollm2 GGUF       # convert, graft 4 min, decode vs plain vs mlx-lm (~9 min)
#   bash bench/gpu.sh all GGUF           # both (longer than one 10-minute device call)
set -euo pipefail
cd "$(dirname "$0")/.."
part=${1:-all}
gguf=${2:-}
work=${WORK:-/tmp/mtpkit-gpu}
mkdir -p "$work"
py=${PYTHON:-python3}
if [ "$part" = mechanics ] || [ "$part" = all ]; then
  $py bench/bench_gpu.py --parts q4,oracle,bf16 --tag gpu-mechanics
fi
if [ "$part" = smollm2 ] || [ "$part" = all ]; then
  [ -n "$gguf" ] || { echo "usage: bash bench/gpu.sh smollm2 SmolLM2-135M-Instruct.Q4_1.gguf" >&2; exit 2; }
  [ -f "$work/smollm2/mtpkit.json" ] || $py -m mtpkit.cli convert "$gguf" "$work/smollm2"
  [ -f "$work/smollm2-mtp/mtpkit.json" ] || $py -m mtpkit.cli graft "$work/smollm2" \
    --out "$work/smollm2-mtp" --minutes 4
  $py bench/bench_gpu.py --parts smollm2 --smollm2 "$work/smollm2" --tag gpu-smollm2-curve
  $py bench/bench_decode.py --workdir "$work" --bundle "$work/smollm2-mtp" \
    --loads held_code,held_memo,code,memo,translation --depths auto,1,2,3 --runs 3 \
    --max-tokens 256 --drop 32 --tag gpu-smollm2
fi

#!/usr/bin/env bash
# The GPU benchmark of issue 19, on a machine set up as ../shared/reference/gpu.md says (after
# `source /root/gpu-env.sh`), from the project root. Results: bench/results/gpu-*.json.
#   bash bench/gpu.sh mechanics          # c(T) before/after (8B 4-bit, 8B bf16), oracle (~4 min)
#   bash bench/gpu.sh breakdown          # host build / hand-off / device time per verify width
#   bash bench/gpu.sh graft GGUF         # convert, graft 4 min (~5 min)
#   bash bench/gpu.sh smollm2 GGUF       # (graft if missing,) then decode: head, head + context,
#                                        # context alone, vs our plain vs mlx-lm (~7 min)
#   bash bench/gpu.sh all GGUF           # everything (longer than one 10-minute device call)
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
if [ "$part" = breakdown ] || [ "$part" = all ]; then
  $py bench/bench_gpu.py --parts breakdown --tag gpu-breakdown
fi
if [ "$part" = graft ] || [ "$part" = smollm2 ] || [ "$part" = all ]; then
  [ -n "$gguf" ] || { echo "usage: bash bench/gpu.sh $part SmolLM2-135M-Instruct.Q4_1.gguf" >&2; exit 2; }
  [ -f "$work/smollm2/mtpkit.json" ] || $py -m mtpkit.cli convert "$gguf" "$work/smollm2"
  [ -f "$work/smollm2-mtp/mtpkit.json" ] || $py -m mtpkit.cli graft "$work/smollm2" \
    --out "$work/smollm2-mtp" --minutes 4
fi
if [ "$part" = smollm2 ] || [ "$part" = all ]; then
  common=(--workdir "$work" --runs 3 --max-tokens 256 --drop 32 --nonce-seed 1)
  $py bench/bench_decode.py "${common[@]}" --bundle "$work/smollm2-mtp" --draft head \
    --loads held_code,held_memo,code,memo --depths auto,1,2,3 --tag gpu-smollm2
  $py bench/bench_decode.py "${common[@]}" --bundle "$work/smollm2-mtp" --draft both \
    --loads held_code,held_memo,edit --depths auto --tag gpu-smollm2-both
  $py bench/bench_decode.py "${common[@]}" --bundle "$work/smollm2" --draft lookup \
    --loads edit,code,memo --depths auto --tag gpu-smollm2-lookup
fi

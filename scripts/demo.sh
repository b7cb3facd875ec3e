#!/usr/bin/env bash
# Set up .venv and run the main job on the built-in default: build a small Qwen3.5-MoE-style
# bundle with an MTP sidecar (stock mlx-lm trunk), then diagnose it with mtpkit doctor.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1
out=${1:-out/demo}
if [ ! -d "$out" ]; then
  .venv/bin/python tests/fixtures/build.py qwen3_5_moe "$out" --policy layers >&2
fi
.venv/bin/mtpkit doctor "$out"

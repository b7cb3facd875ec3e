#!/usr/bin/env bash
# Set up .venv and run the main job on the built-in default: MTP speculative decoding on a real
# trained model. Builds the tiny Qwen3.5 (hybrid linear attention) trained from scratch with its
# MTP head (~2 minutes on 2 CPU cores, once), diagnoses it with mtpkit doctor, then generates
# from held-out-style code with MTP, after a warmed-up plain run: acceptance per draft position,
# speedup, and whether the tokens equal plain decoding's.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1
out=${1:-out/trained-qwen3_5}
if [ ! -f "$out/trained.json" ]; then
  rm -rf "$out"
  .venv/bin/python tests/fixtures/trained.py qwen3_5 "$out" > /dev/null
fi
.venv/bin/mtpkit doctor "$out"
.venv/bin/mtpkit generate "$out" "def parse_header(self, line):" --raw --depth 4 \
  --rollback replay --max-tokens 256 --dtype float32 --compare

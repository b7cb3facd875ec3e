#!/usr/bin/env bash
# Set up .venv with the test extras and run the whole suite offline.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
.venv/bin/python -m ruff check .
.venv/bin/python -m pytest "$@"
# The whole suite (CI) also holds the declared dependency floors: a second venv with every direct
# dependency at its lower bound, and a smoke set run there (~45 s from scratch, ~20 s reused).
if [ $# -eq 0 ]; then
  bash scripts/floors.sh
fi

#!/usr/bin/env bash
# Set up .venv with the test extras and run the whole suite offline.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
.venv/bin/python -m ruff check .
.venv/bin/python -m pytest "$@"

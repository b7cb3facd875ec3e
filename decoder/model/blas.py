"""Which BLAS MLX's CPU backend uses, and an optimized one loaded ahead of MLX where installed.

MLX's Linux CPU wheel (`mlx-cpu`) bundles the reference BLAS, which runs a matmul of M rows in
about M times the cost of one row: verify passes then cost as much as the tokens they check, and
a graft trains ~50x fewer steps in its budget. A library loaded with RTLD_GLOBAL before MLX is
imported serves MLX's `cblas_sgemm` exactly as LD_PRELOAD would, so `mtpkit/__init__.py` calls
`use_optimized()` before anything imports MLX. This module must not import MLX itself.
MTPKIT_BLAS=reference keeps the wheel's BLAS; MTPKIT_BLAS=/path/to/lib.so picks a library.
"""

from __future__ import annotations

import ctypes
import os
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

ENV = "MTPKIT_BLAS"
OFF = ("reference", "off", "none", "0")
INSTALL_HINT = ("install OpenBLAS (Debian/Ubuntu: sudo apt-get install libopenblas0-pthread; "
                "Fedora: sudo dnf install openblas-threads) and mtpkit loads it by itself")
# Preference order. OpenBLAS's threaded builds first (Debian/Ubuntu keep each variant in its own
# folder; Fedora names them libopenblasp/libopenblaso), then MKL and BLIS, which also export cblas.
NAMES = (
    "openblas-pthread/libopenblas.so.0", "libopenblasp.so.0", "libopenblas.so.0",
    "openblas-openmp/libopenblas.so.0", "libopenblaso.so.0",
    "openblas-serial/libopenblas.so.0", "libopenblas.so",
    "libmkl_rt.so.2", "libmkl_rt.so",
    "blis-pthread/libblis.so.4", "libblis.so.4", "blis-openmp/libblis.so.4",
)
OPTIMIZED = ("libopenblas", "libmkl_rt", "libblis")
LD_CACHE = Path("/etc/ld.so.cache")
# Absolute library paths inside ld.so.cache's string table (read directly: no ldconfig process).
_CACHED = re.compile(rb"/[\x21-\x7e]*/lib(?:openblas[po]?|mkl_rt|blis)\.so[\x21-\x7e]*")


@dataclass(frozen=True)
class Loading:
    """What use_optimized() did: the library it loaded, or why it loaded none."""

    path: str | None
    reason: str  # "loaded", "opted out", "preloaded", "late", "none installed", "not linux", ...


LOADING: Loading | None = None


def search_dirs() -> list[Path]:
    """LD_LIBRARY_PATH, then the usual Debian/Ubuntu (multiarch), Fedora and source-build folders."""
    arch = f"{os.uname().machine}-linux-gnu"
    extra = [Path(p) for p in os.environ.get("LD_LIBRARY_PATH", "").split(":") if p]
    return [*extra, Path("/usr/lib") / arch, Path("/lib") / arch, Path("/usr/lib64"),
            Path("/usr/local/lib"), Path("/usr/lib"), Path("/opt/OpenBLAS/lib")]


def candidates(dirs: Sequence[Path], ld_cache: Path = LD_CACHE) -> list[Path]:
    """Installed optimized BLAS libraries, best first: NAMES in `dirs`, then the linker cache."""
    found = [d / name for name in NAMES for d in dirs if (d / name).exists()]
    try:
        cached = [Path(m.decode()) for m in _CACHED.findall(ld_cache.read_bytes())]
    except OSError:
        cached = []
    found += [p for p in cached if p.exists()]
    return list(dict.fromkeys(found))


def _load(choice: str) -> Loading:
    if not sys.platform.startswith("linux"):
        return Loading(None, "not linux")  # macOS: MLX uses Accelerate
    if choice.lower() in OFF:
        return Loading(None, "opted out")
    if "mlx.core" in sys.modules:
        return Loading(None, "late")
    if any(tag in os.environ.get("LD_PRELOAD", "") for tag in OPTIMIZED):
        return Loading(None, "preloaded")
    failed = []
    for path in [Path(choice)] if choice else candidates(search_dirs()):
        try:
            ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
        except OSError as exc:
            failed.append(f"{path}: {exc}")
            continue
        return Loading(str(path), "loaded")
    return Loading(None, "failed: " + "; ".join(failed) if failed else "none installed")


def use_optimized() -> Loading:
    """Load an installed optimized BLAS globally, once, before MLX is imported. Never raises:
    a failure leaves MLX on its own BLAS and is reported by note()."""
    global LOADING
    if LOADING is None:
        try:
            LOADING = _load(os.environ.get(ENV, "").strip())
        except Exception as exc:  # an import must never fail over a speed-up
            LOADING = Loading(None, f"failed: {exc}")
    return LOADING


def in_use() -> tuple[str | None, str | None]:
    """('optimized' | 'reference' | None, the library's path), from /proc/self/maps. None: not
    Linux, or MLX's CPU backend is not loaded."""
    maps = Path("/proc/self/maps")
    if not sys.platform.startswith("linux") or not maps.exists():
        return None, None
    paths = {line.split(maxsplit=5)[-1] for line in maps.read_text().splitlines() if ".so" in line}
    # numpy's own OpenBLAS (libscipy_openblas64_*) renames its symbols, so it never serves MLX.
    for kind, prefixes in (("optimized", OPTIMIZED), ("reference", ("libblas",))):
        found = sorted(p for p in paths if p.rsplit("/", 1)[-1].startswith(prefixes))
        if found:
            return kind, found[0]
    return None, None


def loaded_blas() -> str | None:
    """'optimized', 'reference' or None (not Linux / not determinable)."""
    return in_use()[0]


def fix() -> str:
    """How to get MLX onto an optimized BLAS, given why it is not on one."""
    loading = LOADING or Loading(None, "not attempted")
    if loading.reason == "opted out":
        return f"unset {ENV} (it is {os.environ.get(ENV)!r}) and mtpkit loads an installed one"
    if loading.reason == "late":
        return ("mlx was imported before mtpkit, too late to load one: import mtpkit first, or "
                "export LD_PRELOAD=/path/to/libopenblas.so.0")
    if loading.reason.startswith("failed"):
        return f"loading one {loading.reason}; point {ENV} at a working library"
    return INSTALL_HINT


def describe() -> str | None:
    """One line saying which BLAS MLX's float32 matmuls use (None off Linux)."""
    kind, path = in_use()
    if kind == "optimized":
        how = ("loaded by mtpkit; MTPKIT_BLAS=reference keeps MLX's own"
               if LOADING is not None and LOADING.path else "preloaded")
        return f"BLAS: {path} ({how})"
    if kind == "reference":
        return f"BLAS: the reference BLAS bundled with MLX's Linux wheel ({path})"
    return None


def note() -> str | None:
    """A one-line advisory when MLX runs on the reference BLAS, else None."""
    if loaded_blas() != "reference":
        return None
    return ("note: MLX is using the reference BLAS bundled with its Linux wheel (slow float32 "
            f"matmuls: verifying K tokens costs about K steps); for an optimized one: {fix()}")

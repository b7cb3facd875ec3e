"""An optimized BLAS found and loaded ahead of MLX, the opt-out, and what mtpkit says about it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from mtpkit.decoder.model import blas
from mtpkit.train import graft as graft_mod

ARCH = "x86_64-linux-gnu"


def _touch(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"")
    return path


def test_candidates_prefer_threaded_openblas_and_read_the_linker_cache(tmp_path: Path) -> None:
    debian, fedora = tmp_path / "usr/lib" / ARCH, tmp_path / "usr/lib64"
    _touch(debian / "libblas.so.3")  # the reference BLAS is never a candidate
    serial = _touch(debian / "openblas-serial/libopenblas.so.0")
    pthread = _touch(debian / "openblas-pthread/libopenblas.so.0")
    openmp = _touch(fedora / "libopenblaso.so.0")
    mkl = _touch(fedora / "libmkl_rt.so.2")
    blis = _touch(tmp_path / "elsewhere/libblis.so.4")
    cache = tmp_path / "ld.so.cache"
    cache.write_bytes(b"glibc-ld.so.cache1.1\x00libblis.so.4\x00" + str(blis).encode()
                      + b"\x00libopenblas.so.0\x00/gone/libopenblas.so.0\x00")
    found = blas.candidates([debian, fedora], cache)
    assert found == [pthread, openmp, serial, mkl, blis]
    assert blas.candidates([tmp_path / "empty"], tmp_path / "no-cache") == []


def test_search_dirs_put_ld_library_path_first(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LD_LIBRARY_PATH", "/opt/a::/opt/b")
    dirs = blas.search_dirs()
    assert dirs[:2] == [Path("/opt/a"), Path("/opt/b")]
    assert Path("/usr/lib") / f"{os.uname().machine}-linux-gnu" in dirs


@pytest.mark.parametrize(("choice", "reason"), [("reference", "opted out"), ("OFF", "opted out")])
def test_opting_out_loads_nothing(monkeypatch: pytest.MonkeyPatch, choice: str,
                                  reason: str) -> None:
    if not sys.platform.startswith("linux"):
        pytest.skip("the loader only acts on Linux")
    monkeypatch.setattr(blas, "LOADING", None)
    monkeypatch.setenv(blas.ENV, choice)
    loading = blas.use_optimized()
    assert loading == blas.Loading(None, reason) and blas.use_optimized() is loading
    assert blas.ENV in blas.fix()


def test_too_late_once_mlx_is_imported(monkeypatch: pytest.MonkeyPatch) -> None:
    if not sys.platform.startswith("linux"):
        pytest.skip("the loader only acts on Linux")
    import mlx.core  # noqa: F401

    monkeypatch.setattr(blas, "LOADING", None)
    monkeypatch.delenv(blas.ENV, raising=False)
    assert blas.use_optimized().reason == "late"
    monkeypatch.setattr(blas, "in_use", lambda: ("reference", "/x/libblas-0.so.3"))
    note = blas.note()
    assert note is not None and "too late" in note and "import mtpkit first" in note


def test_a_missing_chosen_library_never_fails(tmp_path: Path) -> None:
    code = ("import mtpkit; from mtpkit.decoder.model import blas; import mlx.core; "
            "print(blas.LOADING.reason); print(blas.note())")
    env = {**os.environ, blas.ENV: str(tmp_path / "libopenblas.so.0")}
    env.pop("LD_PRELOAD", None)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         check=True).stdout
    if sys.platform.startswith("linux"):
        assert out.startswith("failed: ") and "point MTPKIT_BLAS at a working library" in out


def test_notes_and_the_graft_warning_follow_the_blas_in_use(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(blas, "LOADING", blas.Loading(None, "none installed"))
    monkeypatch.setattr(blas, "in_use", lambda: ("reference", "/w/libblas-bd8a.so.3"))
    assert "reference BLAS" in (blas.describe() or "")
    assert "libopenblas0-pthread" in (blas.note() or "")
    warning = graft_mod.blas_warning()
    assert warning is not None and warning.startswith("warning:")
    assert "29 steps" in warning and "sudo apt-get install libopenblas0-pthread" in warning
    monkeypatch.setattr(blas, "LOADING", blas.Loading("/l/libopenblas.so.0", "loaded"))
    monkeypatch.setattr(blas, "in_use", lambda: ("optimized", "/l/libopenblasp-r0.so"))
    assert blas.note() is None and graft_mod.blas_warning() is None
    assert blas.describe() == ("BLAS: /l/libopenblasp-r0.so (loaded by mtpkit; "
                               "MTPKIT_BLAS=reference keeps MLX's own)")


@pytest.mark.skipif(not blas.candidates(blas.search_dirs()), reason="no optimized BLAS here")
def test_an_installed_blas_serves_mlx_when_mtpkit_comes_first() -> None:
    code = ("import mtpkit, mlx.core; from mtpkit.decoder.model import blas; "
            "print(blas.LOADING.reason, *blas.in_use())")
    env = {k: v for k, v in os.environ.items() if k not in (blas.ENV, "LD_PRELOAD")}
    run = [sys.executable, "-c", code]
    loaded = subprocess.run(run, capture_output=True, text=True, env=env, check=True).stdout
    assert loaded.split()[:2] == ["loaded", "optimized"]
    kept = subprocess.run(run, capture_output=True, text=True, check=True,
                          env={**env, blas.ENV: "reference"}).stdout
    assert kept.split()[:2] == ["opted", "out"] and "reference" in kept

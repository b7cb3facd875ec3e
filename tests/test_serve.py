"""mtpkit serve: the OpenAI-compatible API over the reference decoder, and verify-run against
it and against stock mlx_lm.server (real peers on loopback)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

import mtpkit
from fixtures.fake_servers import in_thread
from mtpkit.cli import main
from mtpkit.loaders.findings import UserError
from mtpkit.schemas import validate
from mtpkit.serve.channels import ChannelSplitter
from mtpkit.serve.server import Server
from mtpkit.serve.service import Service, tool_calls
from mtpkit.verify.endpoint import Endpoint, EndpointError


def serving(bundle: Path, depth: int = 2, api_key: str | None = None,
            max_tokens: int = 512) -> Any:
    """Our own server over `bundle` on loopback (a context manager yielding its base URL)."""
    runner = mtpkit.load(bundle, dtype="float32")
    return in_thread(Server(Service(runner, bundle.name, depth, max_tokens), "127.0.0.1", 0,
                            api_key))


@pytest.mark.parametrize(("pieces", "opened", "want"), [
    (["I think", " hard</th", "ink>\n\nThe answer", " is 4."], True, ("I think hard", "The answer is 4.")),
    (["<thi", "nk>plan</think>", "\n\nOK"], False, ("plan", "OK")),
    (["Hello <think> x"], False, ("", "Hello <think> x")),
    (["only reasoning, never closed"], True, ("only reasoning, never closed", "")),
])
def test_reasoning_channel_split_survives_any_chunking(pieces, opened, want) -> None:
    for split in (pieces, list("".join(pieces))):  # as given, and one character at a time
        s = ChannelSplitter(opened)
        got = [s.feed(p) for p in split] + [s.flush()]
        assert ("".join(r for r, _ in got), "".join(c for _, c in got)) == want


def test_tool_calls_are_parsed_only_when_well_formed() -> None:
    content, calls = tool_calls('Let me check.<tool_call>{"name": "get_time", "arguments": '
                                '{"tz": "UTC"}}</tool_call>')
    assert content == "Let me check." and calls[0]["function"]["name"] == "get_time"
    assert json.loads(calls[0]["function"]["arguments"]) == {"tz": "UTC"}
    bad = "<tool_call>{not json}</tool_call>"
    assert tool_calls(bad) == (bad, [])


def test_refuses_non_loopback_without_key(trained) -> None:
    runner = mtpkit.load(trained["qwen3_5"][0], dtype="float32")
    with pytest.raises(UserError) as err:
        Server(Service(runner, "m", 1, 64), "0.0.0.0", 0, None)
    assert err.value.code == "serve.exposed"
    result = CliRunner().invoke(main, ["serve", str(trained["qwen3_5"][0]), "--host", "0.0.0.0"])
    assert result.exit_code == 2 and "error [serve.exposed]" in result.output


def _post(url: str, path: str, body: dict | bytes, key: str | None = None) -> tuple[int, dict]:
    import http.client
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {key}"} if key else {})
    conn.request("POST", parts.path + path, raw, headers)
    response = conn.getresponse()
    return response.status, json.loads(response.read())


def test_api_answers_streams_and_reports_usage_with_mtp(trained) -> None:
    bundle = trained["qwen3_5"][0]
    messages = [{"role": "user", "content": "Write a parser."}]
    with serving(bundle) as url:
        endpoint = Endpoint(url)
        assert endpoint.model() == bundle.name
        whole = endpoint.ask(messages, max_tokens=48, stream=False, thinking=False)
        streamed = endpoint.ask(messages, max_tokens=48, stream=True, thinking=False)
        plain = endpoint.ask(messages, max_tokens=48, stream=False, thinking=False, depth=0)
        text = endpoint.ask(prompt="def parse(self, line):", max_tokens=24, stream=True)
        status, doc = _post(url, "/chat/completions", {"messages": messages, "max_tokens": 8})
    assert streamed.content == whole.content and streamed.reasoning == whole.reasoning
    assert whole.tokens == streamed.tokens == 48 and whole.mtp["depth"] == 2
    assert len(whole.mtp["acceptance_by_depth"]) == 2 and plain.mtp["depth"] == 0
    assert plain.content == whole.content, "greedy MTP must answer exactly like plain"
    assert len(streamed.text_chunks) <= streamed.tokens
    assert text.tokens == 24 and text.content
    assert status == 200 and doc["object"] == "chat.completion"
    assert doc["usage"]["completion_tokens"] == 8 and doc["usage"]["prompt_tokens"] > 0


def test_api_errors_are_json_and_bounded(trained) -> None:
    bundle = trained["qwen3_5"][0]
    with serving(bundle, api_key="s3cret", max_tokens=64) as url:
        assert _post(url, "/chat/completions", {"messages": []})[0] == 401
        cases = [({"messages": []}, 400, "messages"),
                 ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 65}, 400,
                  "max_tokens"),
                 ({"messages": [{"role": "wizard", "content": "x"}]}, 400, "role"),
                 ({"prompt": ""}, 400, "prompt"),
                 (b"{not json", 400, "JSON"),
                 (b"x" * (2 << 20), 413, "over")]
        for body, status, words in cases:
            path = "/completions" if isinstance(body, dict) and "prompt" in body else "/chat/completions"
            got, doc = _post(url, path, body, key="s3cret")
            assert got == status and words in doc["error"]["message"], (body, doc)
        with pytest.raises(EndpointError, match="HTTP 401"):
            Endpoint(url, api_key="wrong").model()


def test_verify_run_passes_our_own_serve(trained) -> None:
    """The trained fixture thinks (its template opens <think>) and never closes it: the answer
    checks fail truthfully; streaming, counting, exactness and the MTP measurements pass."""
    bundle = trained["qwen3_5"][0]
    with serving(bundle) as url:
        result = CliRunner().invoke(main, ["verify-run", "--endpoint", url, "--loads", "code",
                                           "--runs", "2", "--max-tokens", "48", "--json"])
    doc = json.loads(result.stdout)
    validate(doc, "verify_run")
    status = {c["name"]: c["status"] for c in doc["checks"]}
    assert status["streaming"] == status["counting"] == status["exactness"] == "pass"
    assert status["acceptance"] == status["speedup"] == "pass"
    assert doc["speed"]["mtp_control"] and doc["speed"]["depth"] in (1, 2, 3, 4)
    assert status["answer"] == "fail" and "reasoning" in next(
        c["summary"] for c in doc["checks"] if c["name"] == "answer")
    assert result.exit_code == 1


def test_verify_run_local_bundle_json_and_stamp(trained, tmp_path: Path) -> None:
    from mtpkit.convert.convert import ConvertOptions, convert

    refused = CliRunner().invoke(main, ["verify-run", str(trained["qwen3_5_moe"][0]), "--stamp"])
    assert refused.exit_code == 2 and "error [manifest.missing]" in refused.output
    bundle = convert(str(trained["qwen3_5_moe"][0]), tmp_path / "moe", ConvertOptions()).out
    result = CliRunner().invoke(main, ["verify-run", str(bundle), "--loads", "code", "--runs",
                                       "1", "--max-tokens", "32", "--depth", "2", "--json",
                                       "--stamp"])
    doc = json.loads(result.stdout)
    validate(doc, "verify_run")
    status = {c["name"]: c["status"] for c in doc["checks"]}
    assert status["exactness"] == "pass" and status["counting"] == "pass"
    assert doc["speed"]["depth"] == 2 and doc["record"]["fingerprint"]["files"]
    manifest = json.loads((bundle / "mtpkit.json").read_text())
    assert manifest["verification"]["checks"] == doc["checks"]
    assert "## Verification (mtpkit verify-run)" in (bundle / "README.md").read_text()
    assert mtpkit.open_bundle(bundle).errors == [] and not [
        f for f in mtpkit.open_bundle(bundle).findings if f.code.startswith("manifest.")]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_verify_run_passes_stock_mlx_lm_server(smollm2_bf16: Path) -> None:
    """A real peer: stock mlx_lm.server serving the converted SmolLM2, started on loopback."""
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "mlx_lm", "server", "--model",
                             str(smollm2_bf16), "--port", str(port), "--host", "127.0.0.1"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}/v1"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                Endpoint(url, stall_s=5).model()
                break
            except EndpointError:
                assert proc.poll() is None and time.monotonic() < deadline, "server did not start"
                time.sleep(0.5)
        result = CliRunner().invoke(main, ["verify-run", "--endpoint", url, "--loads", "code",
                                           "--runs", "1", "--max-tokens", "24", "--json"])
        doc = json.loads(result.stdout)
        whole = Endpoint(url).ask([{"role": "user", "content": "Name three colors."}],
                                  max_tokens=12, stream=False)
        streamed = Endpoint(url).ask([{"role": "user", "content": "Name three colors."}],
                                     max_tokens=12, stream=True)
    finally:
        proc.terminate()
        proc.wait(30)
    assert result.exit_code == 0, doc["checks"]
    counting = next(c for c in doc["checks"] if c["name"] == "counting")["evidence"]
    assert counting["tokens"] == counting["tokens_non_streaming"] <= 24
    assert whole.tokens == streamed.tokens and whole.content == streamed.content

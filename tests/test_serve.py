"""mtpkit serve: the OpenAI-compatible API over the reference decoder, and verify-run against
it and against stock mlx_lm.server (real peers on loopback)."""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
from click.testing import CliRunner

import fixtures.numerics  # noqa: F401  (float32 runs in float32 on GPU backends too: exactness below)
import mtpkit
from fixtures.fake_servers import in_thread
from mtpkit.cli import main
from mtpkit.decoder.runner import Piece, Result, Runner
from mtpkit.loaders import templates
from mtpkit.loaders.findings import UserError
from mtpkit.schemas import validate
from mtpkit.serve import protocol
from mtpkit.serve.channels import ChannelSplitter
from mtpkit.serve.server import Server
from mtpkit.serve.service import Service, tool_calls
from mtpkit.verify.endpoint import Endpoint, EndpointError


def serving(bundle: Path | Runner, depth: int | str = 2, api_key: str | None = None,
            max_tokens: int = 512, cache_bytes: int = 0, max_batch: int = 1) -> Any:
    """Our own server over a bundle (or a runner already loaded) on loopback (a context manager
    yielding its base URL)."""
    runner = bundle if isinstance(bundle, Runner) else mtpkit.load(bundle, dtype="float32")
    return in_thread(Server(Service(runner, "m" if isinstance(bundle, Runner) else bundle.name,
                                    depth, max_tokens, cache_bytes=cache_bytes,
                                    max_batch=max_batch), "127.0.0.1", 0, api_key))


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


def _connect(url: str) -> http.client.HTTPConnection:
    parts = urlsplit(url)
    return http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)


def _post(url: str, path: str, body: dict | bytes, key: str | None = None) -> tuple[int, dict]:
    conn = _connect(url)
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {key}"} if key else {})
    conn.request("POST", urlsplit(url).path + path, raw, headers)
    response = conn.getresponse()
    return response.status, json.loads(response.read())


def _events(url: str, path: str, body: dict) -> list[dict]:
    """Every SSE data document of a streamed answer, up to [DONE] (which must come)."""
    conn = _connect(url)
    conn.request("POST", urlsplit(url).path + path, json.dumps(body | {"stream": True}).encode(),
                 {"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200
    lines = [line[len(b"data: "):].strip() for line in response.read().splitlines()
             if line.startswith(b"data: ")]
    assert lines[-1] == b"[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_api_answers_streams_and_reports_usage_with_mtp(trained) -> None:
    bundle = trained["qwen3_5"][0]
    messages = [{"role": "user", "content": "Write a parser."}]
    runner = mtpkit.load(bundle, dtype="float32")
    # Where greedy decoding meets EOS depends on the backend's rounding, not on the server: each
    # answer is held to the plain decode of the same prompt here (its tokens, length and reason).
    expected = runner.generate("def parse(self, line):", 24, depth=0)
    chat = runner.generate(runner.encode(messages, enable_thinking=False), 48, depth=0)
    short = runner.generate(runner.encode(messages), 8, depth=0)
    with serving(bundle) as url:
        endpoint = Endpoint(url)
        assert endpoint.model() == bundle.name
        whole = endpoint.ask(messages, max_tokens=48, stream=False, thinking=False)
        streamed = endpoint.ask(messages, max_tokens=48, stream=True, thinking=False)
        plain = endpoint.ask(messages, max_tokens=48, stream=False, thinking=False, depth=0)
        text = endpoint.ask(prompt="def parse(self, line):", max_tokens=24, stream=True)
        status, doc = _post(url, "/chat/completions", {"messages": messages, "max_tokens": 8})
    assert streamed.content == whole.content and streamed.reasoning == whole.reasoning
    assert whole.tokens == streamed.tokens == len(chat.tokens) and whole.mtp["depth"] == 2
    assert len(whole.mtp["acceptance_by_depth"]) == 2 and plain.mtp["depth"] == 0
    assert plain.content == whole.content, "greedy MTP must answer exactly like plain"
    assert len(streamed.text_chunks) < streamed.tokens, "MTP commits several tokens per chunk"
    assert (text.content, text.tokens, text.finish_reason) == (
        expected.text, len(expected.tokens), expected.finish_reason)
    assert status == 200 and doc["object"] == "chat.completion"
    assert doc["choices"][0]["finish_reason"] == short.finish_reason
    assert doc["usage"]["completion_tokens"] == len(short.tokens)
    assert doc["usage"]["prompt_tokens"] == len(runner.encode(messages))


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
            assert got == status == doc["error"]["code"] and words in doc["error"]["message"], (body, doc)
        with pytest.raises(EndpointError, match="HTTP 401"):
            Endpoint(url, api_key="wrong").model()


# Renders doctor's standard conversation (so a bundle loads with it), then refuses, reaches or
# spins on messages a request chooses: two user turns in a row, a "reach" or a "spin" message.
TRAPS = (
    "{%- for m in messages %}"
    "{%- if m.role == 'user' and loop.previtem is defined and loop.previtem.role == 'user' %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{%- elif m.content == 'reach' %}{{ (m|attr('_' ~ '_class__')).mro() }}"
    "{%- elif m.content == 'spin' %}"
    "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}"
    "{%- endif %}"
    "{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- endfor %}{{- '<|im_start|>assistant\\n' }}"
)


def test_template_errors_on_the_requests_own_messages_are_json_400(bundle_copy, monkeypatch) -> None:
    """The template is the bundle's and renders a standard conversation; these messages are what
    it refuses, so they are a 400, streamed or not, answered within the render bound from a
    request thread (where no signal can stop the template)."""
    bundle = bundle_copy("qwen3_5")
    (bundle / "chat_template.jinja").write_text(TRAPS)
    monkeypatch.setattr(templates, "RENDER_SECONDS", 1)
    user = {"role": "user", "content": "hi"}
    cases = [([user, user], "the chat template rejects these messages: Conversation roles must "
                            "alternate user/assistant/user/assistant/..."),
             ([user, {"role": "tool", "content": "reach"}],
              "the sandbox stopped the chat template: access to attribute '__class__' of 'dict' "
              "object is unsafe."),
             ([{"role": "user", "content": "spin"}],
              "the chat template ran too long: rendering took longer than 1s")]
    with serving(bundle) as url:
        assert _post(url, "/chat/completions", {"messages": [user], "max_tokens": 2})[0] == 200
        for messages, message in cases:
            for stream in (False, True):
                start = time.monotonic()
                status, doc = _post(url, "/chat/completions",
                                    {"messages": messages, "max_tokens": 2, "stream": stream})
                assert (status, doc["error"]) == (400, {
                    "message": message, "type": "invalid_request_error", "param": "messages",
                    "code": 400}), (messages, stream)
                assert time.monotonic() - start < 5


def test_prompt_token_ids_are_checked_against_the_vocabulary(built) -> None:
    runner = mtpkit.load(built("qwen3_5"), dtype="float32")
    vocab = runner.trunk.args.vocab_size
    with serving(runner) as url:
        ok, doc = _post(url, "/completions", {"prompt": [0, vocab - 1], "max_tokens": 2})
        assert ok == 200 and doc["usage"]["prompt_tokens"] == 2
        for bad in (vocab, -1, 1 << 40):
            for stream in (False, True):
                status, doc = _post(url, "/completions", {"prompt": [1, bad, vocab + 5],
                                                          "stream": stream})
                assert (status, doc["error"]["param"], doc["error"]["message"]) == (
                    400, "prompt", f"prompt token id {bad} is outside the vocabulary "
                                   f"(size {vocab}: ids 0 to {vocab - 1})")


def test_http_refusals_are_json_and_leave_the_connection_usable(built) -> None:
    with serving(built("qwen3_5")) as url:
        base = urlsplit(url).path
        conn = _connect(url)  # one kept-alive connection through refusals
        conn.request("GET", base + "/nowhere")
        response = conn.getresponse()
        assert (response.status, json.loads(response.read())["error"]) == (404, {
            "message": f"no route {base}/nowhere", "type": "not_found", "param": None,
            "code": 404})
        conn.request("POST", base + "/chat/nowhere", json.dumps({"messages": []}).encode(),
                     {"Content-Type": "application/json"})
        response = conn.getresponse()
        assert response.status == 404 and json.loads(response.read())["error"]["code"] == 404
        conn.request("GET", base + "/models")  # the 404's body was read, not taken as a request
        response = conn.getresponse()
        assert response.status == 200 and json.loads(response.read())["data"][0]["id"]

        bare = _connect(url)  # no Content-Length: 411, and the connection closes
        bare.putrequest("POST", base + "/chat/completions")
        bare.endheaders()
        response = bare.getresponse()
        assert (response.status, response.getheader("Connection")) == (411, "close")
        assert json.loads(response.read())["error"]["message"] == "Content-Length is required"
        chunked = _connect(url)
        # The server answers 411 after the headers and closes: the client may still be sending
        # the chunked body's terminator then (a broken pipe, not a failure); the answer is read.
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            chunked.request("POST", base + "/chat/completions", iter([b'{"messages": []}']))
        response = chunked.getresponse()
        assert (response.status, response.getheader("Connection")) == (411, "close")

        method = _connect(url)  # the standard library's own refusals speak JSON too
        method.request("PUT", base + "/models")
        response = method.getresponse()
        assert response.status == 501 and json.loads(response.read())["error"] == {
            "message": "Unsupported method ('PUT')", "type": "invalid_request_error",
            "param": None, "code": 501}
        parts = urlsplit(url)
        with socket.create_connection((parts.hostname, parts.port), timeout=60) as raw:
            raw.sendall(f"GET {base}/models HTTP/1.1\r\n".encode() + b"X: y\r\n" * 120 + b"\r\n")
            head, _, body = raw.makefile("rb").read().partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 431 ") and json.loads(body)["error"] == {
            "message": "Too many headers", "type": "invalid_request_error", "param": None,
            "code": 431}


def test_a_server_fault_is_a_json_500_and_a_last_stream_event(built, monkeypatch) -> None:
    runner = mtpkit.load(built("qwen3_5"), dtype="float32")

    def broken(*args: Any, **kwargs: Any) -> Iterator[Piece]:
        yield Piece("partial", [1])
        raise RuntimeError("decoder fell over\nsecond line")

    monkeypatch.setattr(runner, "stream", broken)
    error = {"message": "internal error: RuntimeError: decoder fell over second line",
             "type": "server_error", "param": None, "code": 500}
    with serving(runner) as url:
        status, doc = _post(url, "/completions", {"prompt": "x"})
        assert (status, doc["error"]) == (500, error)
        conn = _connect(url)
        conn.request("POST", urlsplit(url).path + "/completions",
                     json.dumps({"prompt": "x", "stream": True}).encode())
        response = conn.getresponse()
        events = [json.loads(line[len(b"data: "):]) for line in response.read().splitlines()
                  if line.startswith(b"data: ")]
    assert response.status == 200 and events[0]["choices"][0]["text"] == "partial"
    assert events[-1] == {"error": error}


def _scripted(runner: Runner, pieces: list[str]) -> None:
    """The runner's stream replaced by a model that says `pieces` (real stats of a real run)."""
    stats = runner.generate([1, 2, 3], 2, depth=0).stats

    def stream(ids: list[int], max_tokens: int, **options: Any) -> Iterator[Piece]:
        for i, text in enumerate(pieces):
            yield Piece(text, [i])
        yield Piece("", [], Result(list(range(len(pieces))), "".join(pieces), stats, "stop"))

    runner.stream = stream  # type: ignore[method-assign]


def test_tool_calls_are_parsed_from_the_models_output_over_http(built) -> None:
    runner = mtpkit.load(built("qwen3_5"), dtype="float32")
    said = ["Let me check", ".<tool", '_call>{"name": "get_time", ', '"arguments": {"tz": "UTC"}}',
            "</tool_call>"]
    _scripted(runner, said)
    tools = [{"type": "function", "function": {"name": "get_time", "parameters": {}}}]
    body = {"messages": [{"role": "user", "content": "time?"}], "tools": tools,
            "chat_template_kwargs": {"enable_thinking": False}}
    call = {"id": "call_0", "type": "function",
            "function": {"name": "get_time", "arguments": '{"tz": "UTC"}'}}
    with serving(runner) as url:
        status, doc = _post(url, "/chat/completions", body)
        events = _events(url, "/chat/completions", body)
        _, untooled = _post(url, "/chat/completions", {**body, "tools": None})
        _scripted(runner, ["<tool_call>{not json}</tool_call>"])
        _, malformed = _post(url, "/chat/completions", body)
    assert status == 200 and doc["choices"][0]["finish_reason"] == "tool_calls"
    assert doc["choices"][0]["message"] == {"role": "assistant", "content": "Let me check.",
                                            "tool_calls": [call]}
    deltas = [e["choices"][0] for e in events if e["choices"]]
    assert "".join(d["delta"].get("content", "") for d in deltas) == "Let me check."
    assert deltas[-1]["delta"]["tool_calls"] == [{"index": 0, **call}]
    assert deltas[-1]["finish_reason"] == "tool_calls"
    assert untooled["choices"][0] == {"index": 0, "finish_reason": "stop", "message": {
        "role": "assistant", "content": "".join(said)}}
    assert malformed["choices"][0]["finish_reason"] == "stop"
    assert malformed["choices"][0]["message"]["content"] == "<tool_call>{not json}</tool_call>"


def test_sampling_seed_and_depth_over_http_reach_the_decoder(built) -> None:
    runner = mtpkit.load(built("qwen3_5"), dtype="float32")
    seen: list[dict[str, Any]] = []
    stream = runner.stream

    def spy(ids: list[int], max_tokens: int, **options: Any) -> Iterator[Piece]:
        assert options["prefix"] is None and callable(options["stop"])  # no --cache-gb here
        assert options["checkpoints"] == []
        seen.append({k: v for k, v in options.items() if k not in ("prefix", "stop", "checkpoints")})
        return stream(ids, max_tokens, **options)

    runner.stream = spy  # type: ignore[method-assign]
    prompt = {"prompt": "The quick brown fox", "max_tokens": 16}
    hot = prompt | {"temperature": 1.5}

    def text(body: dict) -> tuple[str, dict]:
        status, doc = _post(url, "/completions", body)
        assert status == 200, doc
        return doc["choices"][0]["text"], doc["usage"]["mtp"]

    with serving(runner, depth=2) as url:
        text(prompt | {"temperature": 0.7, "top_p": 0.9, "top_k": 5, "min_p": 0.05, "seed": 7,
                       "mtp_depth": 1})
        assert seen[-1] == {"depth": 1, "temperature": 0.7, "top_p": 0.9, "top_k": 5,
                            "min_p": 0.05, "seed": 7}
        greedy, greedy_mtp = text(prompt)
        assert seen[-1]["depth"] == 2 and greedy_mtp["depth"] == 2
        assert text(hot | {"seed": 1})[0] == text(hot | {"seed": 1})[0], "same seed, same text"
        assert text(hot | {"seed": 1})[0] != text(hot | {"seed": 2})[0], "the seed is used"
        assert text(hot | {"seed": 1})[0] != greedy, "the temperature is used"
        assert text(hot | {"seed": 1, "top_k": 1})[0] == greedy, "top_k=1 is greedy"
        assert text(hot | {"seed": 1, "top_p": 1e-9})[0] == greedy, "a tiny top_p is greedy"
        for depth in (0, 1, 3):
            got, mtp = text(prompt | {"mtp_depth": depth})
            assert got == greedy and mtp["depth"] == depth, depth
            assert len(mtp["acceptance_by_depth"]) == depth
        calls = len(seen)
        for name, value in [("temperature", 2.5), ("temperature", "hot"), ("top_p", 0),
                            ("top_k", -1), ("top_k", 1.5), ("min_p", 2), ("seed", "x"),
                            ("seed", True), ("mtp_depth", -1), ("mtp_depth", 17),
                            ("mtp_depth", 1.0)]:
            status, doc = _post(url, "/completions", prompt | {name: value})
            assert (status, doc["error"]["param"]) == (400, name), (name, value)
        assert len(seen) == calls, "a refused request never reaches the decoder"


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
    assert doc["speed"]["mtp_control"] and doc["speed"]["depth"] == "auto"  # serve takes auto
    assert not doc["speed"]["sweep"] and (depths := doc["speed"]["loads"]["code"]["mtp"]["depths"])
    # whether auto's rounds pay on this fixture is the machine's: acceptance is measured
    # exactly when rounds ran
    speculated = any(d != "0" for d in depths)
    assert status["acceptance"] == ("pass" if speculated else "info") and status["speedup"] == "pass"
    said = next(c["summary"] for c in doc["checks"] if c["name"] == "acceptance")
    assert speculated or "auto decoded plainly" in said, said
    assert status["answer"] == "fail" and "reasoning" in next(
        c["summary"] for c in doc["checks"] if c["name"] == "answer")
    assert status["prefix_cache"] == "info" and status["anthropic"] == "pass"  # no --cache-gb
    assert result.exit_code == 1


def test_verify_run_checks_the_prefix_cache_and_the_messages_api(trained, monkeypatch) -> None:
    """With a prefix cache: the second turn reads the first from it, answers as the same turn
    prefilled cold ("prefix_cache": false) and sooner; the Messages API agrees with the chat
    API. A server that ignored "prefix_cache": false would fail the check."""
    from mtpkit.verify.endpoint import serving_checks

    runner = mtpkit.load(trained["qwen3_5"][0], dtype="float32")
    service = Service(runner, "m", 2, 512, cache_bytes=1 << 30)
    with in_thread(Server(service, "127.0.0.1", 0, None)) as url:
        checks = {c.name: c for c in serving_checks(Endpoint(url), lambda s: None)}
        prefix, messages = checks["prefix_cache"], checks["anthropic"]
        # read from the cache, the same text; sooner or not is one timing each on this
        # machine (the rule itself: test_serving_check_verdicts)
        assert prefix.status == "pass" or "no sooner" in prefix.summary, prefix
        assert 0 < prefix.evidence["cached_tokens"] < prefix.evidence["prompt_tokens"]
        assert prefix.evidence["ttft_ratio"] > 0 and messages.status == "pass", messages
        assert messages.evidence["output_tokens"] == messages.evidence["chat_completion_tokens"]
        monkeypatch.setattr(protocol, "prefix_cache", lambda body: True)  # "false" unheard
        deafened = serving_checks(Endpoint(url), lambda s: None)[0]
    assert deafened.status == "fail" and "was not honoured" in deafened.summary


def test_verify_run_local_bundle_json_and_stamp(trained, tmp_path: Path) -> None:
    from mtpkit.convert.convert import ConvertOptions, convert

    refused = CliRunner().invoke(main, ["verify-run", str(trained["qwen3_5_moe"][0]), "--stamp"])
    assert refused.exit_code == 2 and "error [manifest.missing]" in refused.output
    bundle = convert(str(trained["qwen3_5_moe"][0]), tmp_path / "moe", ConvertOptions()).out
    # float32: the exactness check is a proof there on every backend (a bf16 verify pass may
    # flip a near-tie, and where it does depends on the backend's rounding)
    result = CliRunner().invoke(main, ["verify-run", str(bundle), "--loads", "code", "--runs",
                                       "1", "--max-tokens", "32", "--depth", "2", "--json",
                                       "--stamp", "--dtype", "float32"])
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
        # a bf16 model on a shared CPU answers slowly: the stall and wall bounds are generous
        # (this checks compatibility, not speed)
        result = CliRunner().invoke(main, ["verify-run", "--endpoint", url, "--loads", "code",
                                           "--runs", "1", "--max-tokens", "24", "--json",
                                           "--timeout", "300"])
        doc = json.loads(result.stdout)
        whole = Endpoint(url).ask([{"role": "user", "content": "Name three colors."}],
                                  max_tokens=12, stream=False)
        streamed = Endpoint(url).ask([{"role": "user", "content": "Name three colors."}],
                                     max_tokens=12, stream=True)
    finally:
        proc.terminate()
        proc.wait(30)
    assert result.exit_code == 0, [c for c in doc["checks"] if c["status"] == "fail"]
    status = {c["name"]: c for c in doc["checks"]}
    assert status["prefix_cache"]["status"] == status["anthropic"]["status"] == "info"
    assert "HTTP 404" in status["anthropic"]["summary"], "mlx_lm.server has no Messages API"
    counting = next(c for c in doc["checks"] if c["name"] == "counting")["evidence"]
    assert counting["tokens"] == counting["tokens_non_streaming"] <= 24
    assert whole.tokens == streamed.tokens and whole.content == streamed.content


def test_serving_check_verdicts() -> None:
    """prefix_cache and anthropic fail on each thing they guard, and say which."""
    from mtpkit.verify.answer import Answer, Chunk
    from mtpkit.verify.checks import anthropic_check, prefix_cache_check

    def answer(text: str, at: float = 0.1, tokens: int = 5, prompt: int = 90) -> Answer:
        return Answer(text, "", tokens, prompt, "stop", [Chunk(at, text)])

    cold, warm = answer("same", 2.0), answer("same", 0.2)
    verdicts = [(prefix_cache_check(cold, warm, 80, None), "pass", "80 of 90 prompt tokens"),
                (prefix_cache_check(cold, warm, 0, None), "fail", "read nothing"),
                (prefix_cache_check(cold, warm, 80, 80), "fail", "was not honoured"),
                (prefix_cache_check(cold, answer("sane", 0.2), 80, None), "fail",
                 "content differs from the cold one at char 2"),
                (prefix_cache_check(cold, answer("same", 2.5), 80, None), "fail", "no sooner")]
    whole = answer("three uses")
    verdicts += [(anthropic_check(whole, whole, whole), "pass", "5 output tokens"),
                 (anthropic_check(whole, answer("three"), whole), "fail",
                  "differs from the stream at char 5"),
                 (anthropic_check(whole, whole, answer("three usez")), "fail",
                  "differs from the chat API's answer at char 9"),
                 (anthropic_check(whole, answer("three uses", tokens=6), whole), "fail",
                  "5 whole, 6 streamed"),
                 (anthropic_check(whole, whole, answer("three uses", prompt=91)), "fail",
                  "input tokens differ: 90 (Messages) vs 91 (chat)")]
    for check, status, words in verdicts:
        assert check.status == status and words in check.summary, check

"""Hostile requests to `mtpkit serve` and `mtpkit generate` (issue 31, items 2, 5 and 8): each
is answered by a one-line error with its code (a 400 or 403 in the API's shape, or exit 2)
within seconds, and the server goes on answering /health and other clients throughout: an
over-long prompt, a client gone in the middle of a long prefill, a web page's request under a
rebound name or from another origin, fields the server cannot honour, JSON built to break the
parser. The API key may come from the environment or a file, off the command line."""

from __future__ import annotations

import http.client
import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
from click.testing import CliRunner

import mtpkit
from fixtures.fake_servers import in_thread
from fixtures.serving import serve_process, until
from mtpkit.cli import main
from mtpkit.decoder.context import check_prompt, context_of
from mtpkit.decoder.runner import Runner
from mtpkit.loaders.findings import UserError
from mtpkit.serve.server import KEY_ENV, KEYS_ENV, Server, api_keys_from
from mtpkit.serve.service import Service

LONG = "ab " * 300000  # 900,000 bytes (under the 1 MiB body bound), 600,001 tokens here


@contextmanager
def serving(runner: Runner, api_key: str | None = None) -> Iterator[str]:
    """Our server over `runner` on loopback, plain decoding; yields its root URL."""
    with in_thread(Server(Service(runner, "m", 0, 64), "127.0.0.1", 0, api_key)) as url:
        yield url.removesuffix("/v1")


def call(url: str, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None,
         timeout: float = 60) -> tuple[int, Any]:
    """One request on its own connection: (status, the JSON body or the text)."""
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout)
    raw = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    conn.request(method, path, raw, {"Content-Type": "application/json"} | (headers or {}))
    response = conn.getresponse()
    data = response.read()
    conn.close()
    try:
        return response.status, json.loads(data)
    except ValueError:
        return response.status, data.decode("utf-8", "replace")


def message(doc: dict) -> str:
    return doc["error"]["message"]


@pytest.fixture(scope="module")
def runner(built: Any) -> Runner:
    """The tiny Qwen3.5 bundle (context 4,096 tokens in its config)."""
    loaded = mtpkit.load(built("qwen3_5"))
    assert loaded.context == 4096
    return loaded


# -- prompt bound ------------------------------------------------------------------------------


def test_the_context_and_the_option_bound_every_entry() -> None:
    assert context_of({"max_position_embeddings": 4096}) == 4096
    assert context_of({"n_positions": 1024}) == 1024
    assert context_of({"hidden_size": 64}) is None
    yarn = {"max_position_embeddings": 32768, "rope_scaling": {
        "type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}}
    assert context_of(yarn) == 131072  # Qwen's long-context recipe keeps the original length
    check_prompt(4096, 4096, None)
    check_prompt(10**6, None, None)  # no context declared, no option: no bound
    check_prompt(5000, 4096, 8192)  # the option replaces the context
    for tokens, context, option, why in ((4097, 4096, None, "context"),
                                         (9, 4096, 8, "--max-prompt-tokens")):
        with pytest.raises(UserError) as err:
            check_prompt(tokens, context, option)
        assert err.value.code == "prompt.too_long" and why in str(err.value)


def test_an_overlong_prompt_is_a_400_before_any_work(runner: Runner) -> None:
    """The reproduction: 300,000 "ab " held the only worker for minutes of prefill. Now each
    API refuses it in seconds (tokenizing is the only work), /health answers meanwhile, and
    the next client is served."""
    with serving(runner) as url:
        answers: dict[str, tuple[int, Any]] = {}
        bodies = {"/v1/completions": {"prompt": LONG, "max_tokens": 4},
                  "/v1/chat/completions": {"messages": [{"role": "user", "content": LONG}]},
                  "/v1/messages": {"max_tokens": 4, "messages": [{"role": "user",
                                                                  "content": LONG}]}}

        def ask(path: str) -> None:
            answers[path] = call(url, "POST", path, bodies[path], timeout=30)

        start = time.monotonic()
        threads = [threading.Thread(target=ask, args=(p,)) for p in bodies]
        for thread in threads:
            thread.start()
        assert call(url, "GET", "/health", timeout=5) == (200, {"status": "ok"})
        for thread in threads:
            thread.join(60)
        assert time.monotonic() - start < 30
        for path, (status, doc) in answers.items():
            text = doc["error"]["message"]
            assert status == 400 and "prompt.too_long: the prompt is" in text, (path, doc)
            assert "the limit is 4096 (the model's context" in text and "\n" not in text
        assert answers["/v1/completions"][1]["error"]["param"] == "prompt"
        assert answers["/v1/messages"][1]["type"] == "error"  # Anthropic's shape
        assert call(url, "POST", "/v1/completions", {"prompt": "ab", "max_tokens": 2})[0] == 200


def test_max_prompt_tokens_bounds_serve_and_generate(built: Any) -> None:
    """--max-prompt-tokens: the same refusal, the same code, from serve (both APIs) and
    generate (one line, exit 2); the model's context bounds generate without it."""
    bundle = built("qwen3_5")
    with serve_process(bundle, "--depth", "0", "--max-prompt-tokens", "8") as url:
        status, doc = call(url, "POST", "/v1/completions", {"prompt": "ab " * 8, "max_tokens": 2})
        assert status == 400 and message(doc).startswith("prompt.too_long: the prompt is 17 "
                                                         "tokens; the limit is 8 (--max-prompt")
        status, doc = call(url, "POST", "/v1/messages", {
            "max_tokens": 2, "messages": [{"role": "user", "content": "ab " * 8}]})
        assert status == 400 and "prompt.too_long" in doc["error"]["message"]
        status, _ = call(url, "POST", "/v1/completions", {"prompt": "ab ab", "max_tokens": 2})
        assert status == 200
    for args, said in ((["ab " * 3000], "6001 tokens; the limit is 4096 (the model's context, "
                                        "config.json)"),
                       (["ab " * 8, "--max-prompt-tokens", "8"],
                        "17 tokens; the limit is 8 (--max-prompt-tokens)")):
        result = CliRunner().invoke(main, ["generate", str(bundle), *args, "--raw", "--depth",
                                           "0", "--max-tokens", "2"])
        assert result.exit_code == 2, result.output
        lines = result.output.splitlines()
        at = next(i for i, line in enumerate(lines) if line.startswith("error ["))
        assert lines[at] == f"error [prompt.too_long]: the prompt is {said}", lines
        assert lines[at + 1].startswith("  hint:") and len(lines) == at + 2


def test_the_library_refuses_an_overlong_prompt_too(runner: Runner) -> None:
    with pytest.raises(UserError) as err:
        runner.generate([5] * 4097, 2, depth=0)
    assert err.value.code == "prompt.too_long"


# -- a client gone during the prefill ------------------------------------------------------------


def test_stop_is_asked_between_prefill_chunks(runner: Runner) -> None:
    """The decoder's own check: stop() true after the first chunk ends the generation there,
    nothing generated, the prefilled tokens counted."""
    asked: list[int] = []

    def stop() -> bool:
        asked.append(1)
        return True

    pieces = list(runner.stream([5] * 4000, 8, depth=0, stop=stop))
    result = pieces[-1].result
    assert result is not None and result.tokens == [] and len(pieces) == 1
    assert len(asked) == 1 and 0 < result.stats.prompt_tokens < 4000


def test_a_client_gone_mid_prefill_frees_the_worker_within_a_chunk(bundle_copy: Any) -> None:
    """A long prompt (under the bound) whose client leaves during the prefill: the prefill
    ends at the next chunk, so the next client is answered in seconds, not after the whole
    prefill; the tokens counted show where it stopped."""
    bundle = bundle_copy("qwen3_5")
    config = json.loads((bundle / "config.json").read_text())
    config["text_config"]["max_position_embeddings"] = 1 << 16
    (bundle / "config.json").write_text(json.dumps(config))
    long = [7] * 24000  # 12 chunks of 2,048: about a minute of prefill on a 2-core CPU
    with serving(mtpkit.load(bundle)) as url:
        parts = urlsplit(url)
        conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
        conn.request("POST", "/v1/completions", json.dumps({"prompt": long, "max_tokens": 4}),
                     {"Content-Type": "application/json"})

        def running() -> bool:
            _, text = call(url, "GET", "/metrics", timeout=5)
            return "mtpkit_requests_running 1.0" in text

        until(running, "the long prompt never started", 30)
        conn.close()  # gone, in the middle of the prefill
        gone = time.monotonic()
        assert call(url, "GET", "/health", timeout=5)[0] == 200
        status, doc = call(url, "POST", "/v1/completions", {"prompt": "ab", "max_tokens": 2})
        waited = time.monotonic() - gone
        assert status == 200 and doc["object"] == "text_completion"
        _, text = call(url, "GET", "/metrics", timeout=5)
        counted = next(float(line.split()[1]) for line in text.splitlines()
                       if line.startswith("mtpkit_prompt_tokens_total"))
    assert counted < len(long), "the gone client's prefill ran to its end"
    assert waited < 20, f"the next client waited {waited:.1f} s"


# -- a web page as the client: Host and Origin -----------------------------------------------------


def test_a_rebound_host_is_refused_without_a_key(runner: Runner) -> None:
    """DNS rebinding: a page at http://evil.example:PORT whose name now resolves to 127.0.0.1
    sends its own name as Host. Without a key only loopback names are answered, /health
    and the page included; with a key the key decides."""
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    with serving(runner) as url:
        port = urlsplit(url).port
        for host in (f"evil.example:{port}", "evil.example", f"127.0.0.1.evil.example:{port}",
                     "localhost@evil.example", ""):
            for method, path, body in (("GET", "/health", None), ("GET", "/", None),
                                       ("GET", "/v1/models", None),
                                       ("POST", "/v1/chat/completions", chat)):
                status, doc = call(url, method, path, body, {"Host": host})
                assert status == 403 and message(doc).startswith("serve.host: Host "), (host, path)
        status, doc = call(url, "POST", "/v1/messages", {"max_tokens": 2, **chat},
                           {"Host": f"evil.example:{port}"})
        assert status == 403 and doc["error"]["type"] == "permission_error"
        for host in (f"127.0.0.1:{port}", f"localhost:{port}", f"[::1]:{port}", "localhost"):
            assert call(url, "GET", "/health", None, {"Host": host})[0] == 200, host
        assert call(url, "POST", "/v1/chat/completions", chat,
                    {"Host": f"localhost:{port}"})[0] == 200
    with serving(runner, api_key="k") as url:
        status, _ = call(url, "GET", "/health", None, {"Host": "api.example.com",
                                                       "Authorization": "Bearer k"})
        assert status == 200  # exposed servers are reached under names they cannot know


def test_cross_origin_requests_are_refused_the_page_still_works(runner: Runner) -> None:
    """A page elsewhere may POST text/plain without a preflight: refused (403) without a key;
    a preflight is never granted. The chat page's own calls (same origin) go through."""
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    with serving(runner) as url:
        own = f"127.0.0.1:{urlsplit(url).port}"
        for origin in ("http://evil.example", "null", f"https://{own}", f"http://{own}/x",
                       f"http://localhost:{urlsplit(url).port}"):
            status, doc = call(url, "POST", "/v1/chat/completions", json.dumps(chat).encode(),
                               {"Content-Type": "text/plain", "Origin": origin})
            assert status == 403 and message(doc).startswith("serve.origin: cross-origin "), origin
        status, doc = call(url, "OPTIONS", "/v1/chat/completions", None, {
            "Origin": "http://evil.example", "Access-Control-Request-Method": "POST"})
        assert status == 403 and "serve.origin" in message(doc)
        status, page = call(url, "GET", "/", None, {"Host": own})
        assert status == 200 and "<html" in page.lower()
        for headers in ({"Host": own, "Origin": f"http://{own}"}, {"Host": own}):
            status, doc = call(url, "POST", "/v1/chat/completions", chat, headers)
            assert status == 200 and doc["object"] == "chat.completion"
        assert call(url, "GET", "/v1/models", None, {"Origin": f"http://{own}"})[0] == 200


# -- the API key off the command line ----------------------------------------------------------------


def test_the_keys_come_from_the_options_a_file_or_the_environment(tmp_path: Path) -> None:
    keyfile = tmp_path / "keys"
    keyfile.write_text("# the tenants\nfrom-file\n\n  second  \nfrom-file\n")
    env = {KEY_ENV: "from-env", KEYS_ENV: "a, b\nc,"}
    assert api_keys_from([], keyfile, env) == ["from-file", "second"]
    assert api_keys_from(["given", "again"], None, env) == ["given", "again"]
    assert api_keys_from([], None, env) == ["a", "b", "c", "from-env"]
    assert api_keys_from([], None, {KEY_ENV: "from-env"}) == ["from-env"]
    assert api_keys_from([], None, {}) == []
    (tmp_path / "blank").write_text("# nothing\n\n")
    cases = [(["given"], keyfile, {}, "usage"), ([], tmp_path / "missing", {}, "serve.api_key"),
             ([], tmp_path / "blank", {}, "serve.api_key"),
             ([], None, {KEY_ENV: ""}, "serve.api_key"), ([], None, {KEYS_ENV: " ,\n"},
                                                          "serve.api_key"),
             (["ok", "  "], None, {}, "serve.api_key")]
    for given, path, env, code in cases:
        with pytest.raises(UserError) as err:
            api_keys_from(given, path, env)
        assert err.value.code == code


def test_serve_takes_the_key_from_env_or_file_and_refuses_a_bad_one(built: Any,
                                                                     tmp_path: Path) -> None:
    bundle = built("qwen3_5")
    keyfile = tmp_path / "key"
    keyfile.write_text("filed-key\n")
    body = {"prompt": "ab", "max_tokens": 2}
    for options, env, key in ((("--api-key-file", str(keyfile)), {}, "filed-key"),
                              ((), {KEY_ENV: "env-key"}, "env-key")):
        with serve_process(bundle, "--depth", "0", *options, env=env) as url:
            assert call(url, "POST", "/v1/completions", body)[0] == 401
            assert call(url, "POST", "/v1/completions", body,
                        {"Authorization": f"Bearer {key}"})[0] == 200
            assert call(url, "GET", "/health", None, {"x-api-key": key})[0] == 200
    runner = CliRunner()
    missing = runner.invoke(main, ["serve", str(bundle), "--api-key-file", str(tmp_path / "no")])
    assert missing.exit_code == 2 and missing.output.startswith(
        f"error [serve.api_key]: cannot read the API key file {tmp_path / 'no'}: ")
    empty = runner.invoke(main, ["serve", str(bundle)], env={KEY_ENV: ""})
    assert empty.exit_code == 2 and "error [serve.api_key]: the API key from $MTPKIT_API_KEY " \
        "is empty" in empty.output


# -- fields the server cannot honour, bodies built to break the parser ------------------------


def test_fields_the_server_cannot_honour_are_refused(runner: Runner) -> None:
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    text = {"prompt": "ab", "max_tokens": 2}
    with serving(runner) as url:
        for path, base, field, value in (
                ("/v1/chat/completions", chat, "logprobs", True),
                ("/v1/chat/completions", chat, "top_logprobs", 3),
                ("/v1/completions", text, "logprobs", 0),
                ("/v1/completions", text, "echo", True),
                ("/v1/completions", text, "best_of", 2),
                ("/v1/completions", text, "suffix", "}"),
                ("/v1/chat/completions", chat, "logit_bias", {"50": 5}),
                ("/v1/chat/completions", chat, "presence_penalty", 0.5),
                ("/v1/chat/completions", chat, "response_format", {"type": "json_object"})):
            status, doc = call(url, "POST", path, base | {field: value})
            assert status == 400 and doc["error"]["param"] == field, (field, doc)
            assert message(doc).startswith(f"request.unsupported: {field} is not supported (")
        for path, base, idle in (("/v1/chat/completions", chat, {
                "logprobs": False, "top_logprobs": 0, "n": 1, "presence_penalty": 0,
                "response_format": {"type": "text"}}),
                ("/v1/completions", text, {"logprobs": None, "echo": False, "best_of": 1})):
            assert call(url, "POST", path, base | idle)[0] == 200, idle


def test_json_built_to_break_the_parser_is_a_400(runner: Runner) -> None:
    """Deep nesting made the parser recurse until it failed and a 5,000-digit integer went past
    Python's own bound: both were 500s. Each is a 400 with its code, in each API's shape, in
    well under a second."""
    cases = [(b"[" * 200000, "request.too_deep"),
             (b'{"messages": ' + b"[" * 70 + b"]" * 70 + b"}", "request.too_deep"),
             (b'{"prompt": "ab", "seed": ' + b"7" * 5000 + b"}", "request.number"),
             (b'{"prompt": "ab", "temperature": NaN}', "request.invalid_json"),
             (b'{"prompt": "a\\ud800b"}', "request.invalid_json")]
    with serving(runner) as url:
        for raw, code in cases:
            for path in ("/v1/completions", "/v1/messages"):
                start = time.monotonic()
                status, doc = call(url, "POST", path, raw)
                assert time.monotonic() - start < 2
                said = doc["error"]["message"]
                assert status == 400 and said.startswith(code + ": "), (raw[:40], path, doc)
        brackets = b'{"prompt": "' + b"[{" * 100 + b'", "max_tokens": 2}'  # in a string: text
        assert call(url, "POST", "/v1/completions", brackets)[0] == 200
        assert call(url, "GET", "/health")[0] == 200


def test_a_port_in_use_is_one_line_before_loading(built: Any) -> None:
    """`serve` on a taken port: one line with its code before the bundle loads (it was an
    OSError traceback after loading), and the same from the server's own bind."""
    import socket
    import subprocess
    import sys

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        start = time.monotonic()
        proc = subprocess.run([sys.executable, "-m", "mtpkit.cli", "serve",
                               str(built("qwen3_5")), "--port", str(port)],
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr.startswith("error [serve.port_in_use]"), proc.stderr
        assert "Traceback" not in proc.stderr and "--port" in proc.stderr
        assert "measuring" not in proc.stderr and "serving" not in proc.stderr
        assert time.monotonic() - start < 60
        with pytest.raises(UserError, match="already in use") as caught:
            Server(Service(mtpkit.load(built("llama"), dtype="float32"), "b", 0, 16), "127.0.0.1",
                   port, None)
        assert caught.value.code == "serve.port_in_use"

"""The draft source as users reach it: `serve --draft` and the per-request "mtp_draft"
extension (usage.mtp reports the source used and per-source telemetry), `verify-run --draft`
(sent to endpoints, passed to local bundles, recorded per load) and `generate --draft`."""

from __future__ import annotations

import http.client
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import jsonschema
import pytest
from click.testing import CliRunner

import fixtures.numerics  # noqa: F401  (float32 runs in float32 on GPU backends too: exactness below)
import mtpkit
from fixtures.fake_servers import in_thread
from mtpkit.cli import main
from mtpkit.decoder.runner import Piece, Runner
from mtpkit.schemas import validate
from mtpkit.serve.protocol import RequestError, parse
from mtpkit.serve.server import Server
from mtpkit.serve.service import Service
from mtpkit.verify.answer import Answer, Chunk
from mtpkit.verify.endpoint import Endpoint
from mtpkit.verify.run import Facts, VerifyOptions, run, table


def _every_token(runner: Runner) -> list[int]:
    """A prompt holding every token once: each round finds an earlier occurrence of the text's
    last token, so context lookup always has a draft (the fixtures' output never repeats)."""
    return list(range(runner.trunk.args.vocab_size))


def _invoke(*args: str) -> Any:
    result = CliRunner().invoke(main, list(args))
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    return result


def _spied(runner: Runner) -> list[dict[str, Any]]:
    """The options every generation reaches the decoder with."""
    seen: list[dict[str, Any]] = []
    stream = runner.stream

    def spy(ids: list[int], max_tokens: int, **options: Any) -> Iterator[Piece]:
        seen.append(options)
        return stream(ids, max_tokens, **options)

    runner.stream = spy  # type: ignore[method-assign]
    return seen


def _post(url: str, body: dict) -> tuple[int, dict]:
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
    conn.request("POST", parts.path + "/completions", json.dumps(body).encode(),
                 {"Content-Type": "application/json"})
    response = conn.getresponse()
    return response.status, json.loads(response.read())


def _streamed_usage(url: str, body: dict) -> dict:
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
    conn.request("POST", parts.path + "/completions", json.dumps(body | {"stream": True}).encode(),
                 {"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200
    events = [json.loads(line[len(b"data: "):]) for line in response.read().splitlines()
              if line.startswith(b"data: ") and line != b"data: [DONE]"]
    return events[-1]["usage"]


def _sources_ok(mtp: dict) -> None:
    """Per-source telemetry adds up to the generation's own counters."""
    sources = mtp["sources"]
    assert sum(s["rounds"] for s in sources.values()) == mtp["verify_calls"], mtp
    for s in sources.values():
        assert s["acceptance_by_depth"] == [a / p if p else 0.0 for a, p in zip(
            s["accepted"], s["proposed"], strict=True)]


# -- the extension ---------------------------------------------------------------------------

def test_mtp_draft_extension_takes_head_lookup_or_both() -> None:
    body = {"prompt": "x"}
    assert parse(body, False, 64).draft is None
    for draft in ("head", "lookup", "both"):
        assert parse(body | {"mtp_draft": draft}, False, 64).draft == draft
    for bad in ("Head", "", "none", "auto", 1, True, ["head"], {"head": 1}):
        with pytest.raises(RequestError) as err:
            parse(body | {"mtp_draft": bad}, False, 64)
        assert (err.value.status, err.value.param) == (400, "mtp_draft"), bad
        assert err.value.message == 'options.invalid: mtp_draft must be "head", "lookup" or "both"'


# -- serve -----------------------------------------------------------------------------------

def test_serve_answers_each_draft_source_with_its_telemetry(built: Callable[..., Path]) -> None:
    runner = mtpkit.load(built("qwen3_5"), dtype="float32")
    seen = _spied(runner)
    body = {"prompt": _every_token(runner), "max_tokens": 24, "mtp_depth": 2}
    with in_thread(Server(Service(runner, "m", 2, 64), "127.0.0.1", 0, None)) as url:
        status, plain = _post(url, body | {"mtp_depth": 0})
        assert status == 200 and plain["usage"]["mtp"]["draft"] is None
        assert plain["usage"]["mtp"]["sources"] == {}
        answers = {}
        for draft in (None, "head", "lookup", "both"):
            status, doc = _post(url, body | ({"mtp_draft": draft} if draft else {}))
            assert status == 200, (draft, doc)
            assert seen[-1].get("draft") == draft, "the asked source reaches the decoder"
            answers[draft] = doc
        streamed = _streamed_usage(url, body | {"mtp_draft": "lookup"})
        bad, error = _post(url, body | {"mtp_draft": "context"})
    text = plain["choices"][0]["text"]
    for draft, doc in answers.items():
        mtp = doc["usage"]["mtp"]
        assert doc["choices"][0]["text"] == text, f"greedy {draft} drafts answer like plain"
        assert mtp["draft"] == (draft or "head"), "a forced depth drafts with the head"
        _sources_ok(mtp)
        assert "depths" in mtp and "predicted_speedup" in mtp
    assert set(answers[None]["usage"]["mtp"]["sources"]) == {"head"}
    assert set(answers["head"]["usage"]["mtp"]["sources"]) == {"head"}
    assert set(answers["lookup"]["usage"]["mtp"]["sources"]) == {"lookup"}
    assert answers["lookup"]["usage"]["mtp"]["sources"]["lookup"]["rounds"] > 0
    both = answers["both"]["usage"]["mtp"]["sources"]  # at a fixed depth: lookup where it can
    assert set(both) <= {"head", "lookup"} and both.get("lookup", {}).get("rounds", 0) > 0
    assert streamed["mtp"]["draft"] == "lookup"
    assert streamed["mtp"]["sources"] == answers["lookup"]["usage"]["mtp"]["sources"]
    assert (bad, error["error"]["param"], error["error"]["code"]) == (400, "mtp_draft", 400)


def test_serve_without_a_head_drafts_from_the_context(built: Callable[..., Path]) -> None:
    runner = mtpkit.load(built("qwen3_5", sidecar=None), dtype="float32")
    seen = _spied(runner)
    body = {"prompt": _every_token(runner), "max_tokens": 24, "mtp_depth": 2}
    with in_thread(Server(Service(runner, "m", 2, 64), "127.0.0.1", 0, None)) as url:
        status, plain = _post(url, body | {"mtp_depth": 0})
        assert status == 200
        calls = len(seen)
        for stream in (False, True):
            status, doc = _post(url, body | {"mtp_draft": "head", "stream": stream})
            assert (status, doc["error"]["param"], doc["error"]["code"]) == (
                400, "mtp_draft", 400), doc
            assert doc["error"]["message"] == ('options.no_head: mtp_draft "head" drafts with an '
                                               'MTP head; this model has none')
        assert len(seen) == calls, "a refused request never reaches the decoder"
        status, default = _post(url, body)
        status_both, both = _post(url, body | {"mtp_draft": "both"})
    assert status == status_both == 200
    text = plain["choices"][0]["text"]
    for doc, draft in ((default, "lookup"), (both, "both")):
        mtp = doc["usage"]["mtp"]
        assert doc["choices"][0]["text"] == text and mtp["draft"] == draft
        assert set(mtp["sources"]) == {"lookup"} and mtp["sources"]["lookup"]["rounds"] > 0
        _sources_ok(mtp)


def test_a_services_default_draft_applies_to_requests_naming_none(built: Callable[..., Path],
                                                                  ) -> None:
    runner = mtpkit.load(built("qwen3_5"), dtype="float32")
    seen = _spied(runner)
    with in_thread(Server(Service(runner, "m", 2, 64, draft="lookup"), "127.0.0.1", 0,
                          None)) as url:
        body = {"prompt": _every_token(runner), "max_tokens": 16}
        _, default = _post(url, body)
        assert seen[-1]["draft"] == "lookup"
        _, head = _post(url, body | {"mtp_draft": "head"})
        assert seen[-1]["draft"] == "head"
    assert set(default["usage"]["mtp"]["sources"]) == {"lookup"}
    assert set(head["usage"]["mtp"]["sources"]) == {"head"}


def test_serve_draft_option(built: Callable[..., Path], monkeypatch: pytest.MonkeyPatch) -> None:
    started: list[Server] = []
    monkeypatch.setattr(Server, "serve_forever", lambda self, *a, **k: started.append(self))
    result = _invoke("serve", str(built("qwen3_5")), "--port", "0", "--depth", "2",
                     "--draft", "lookup")
    assert result.exit_code == 0, result.output
    assert "(MTP depth 2), drafts lookup" in result.stderr
    assert started[-1].service.draft == "lookup"
    default = _invoke("serve", str(built("qwen3_5")), "--port", "0", "--depth", "2")
    assert "(MTP depth 2), drafts head" in default.stderr and started[-1].service.draft is None
    headless = str(built("qwen3_5", sidecar=None))
    refused = _invoke("serve", headless, "--port", "0", "--depth", "2", "--draft", "head")
    assert refused.exit_code == 2, refused.output
    assert 'error [options.no_head]: --draft "head" drafts with an MTP head' in refused.output
    both = _invoke("serve", headless, "--port", "0", "--depth", "2", "--draft", "both")
    assert both.exit_code == 0 and "drafts both" in both.stderr  # the context alone: as a request
    bad = _invoke("serve", headless, "--draft", "context")
    assert bad.exit_code == 2 and "Invalid value for '--draft'" in bad.stderr
    assert len(started) == 3


# -- verify-run ------------------------------------------------------------------------------

class Fake:
    """A target that takes depths and draft sources and reports per-source telemetry."""

    def __init__(self) -> None:
        self.asked: list[tuple[Any, Any]] = []

    def ask(self, messages: list[dict] | None = None, prompt: str | None = None, *,
            max_tokens: int, stream: bool, depth: int | str | None = None,
            thinking: bool | None = None, draft: str | None = None) -> Answer:
        self.asked.append((depth, draft))
        speculative = depth not in (0, None)
        step = 0.01 / (1.5 if speculative else 1.0)
        chunks = [Chunk(step * (i + 1), "word ", "", 1) for i in range(max_tokens)]
        mtp: dict[str, Any] = {"depth": 2 if speculative else 0,
                               "acceptance_by_depth": [0.6, 0.3] if speculative else [],
                               "draft": None, "sources": {}}
        if speculative:
            mtp |= {"draft": draft or "both", "depths": {"0": 1, "2": 3},
                    "sources": {"lookup": {"rounds": 3, "proposed": [3, 2], "accepted": [2, 1],
                                           "acceptance_by_depth": [2 / 3, 0.5]}}}
        return Answer("word " * max_tokens, "", max_tokens, 12, "length",
                      chunks if stream else [], mtp, None, list(range(max_tokens)))


def test_verify_run_sends_the_draft_with_speculative_requests_and_records_it() -> None:
    fake = Fake()
    report = run(fake, Facts("endpoint", "fake", exact_ids=True),
                 VerifyOptions(loads=("code",), runs=2, max_tokens=40, draft="lookup"))
    report.record = {"machine": {"platform": "test", "cores": 1, "versions": {}}}
    doc = report.to_dict()
    validate(doc, "verify_run")
    assert {d for depth, d in fake.asked if depth not in (0, None)} == {"lookup"}
    assert {d for depth, d in fake.asked if depth in (0, None)} == {None}, "plain asks name none"
    speed = doc["speed"]
    assert speed["draft"] == "lookup" and speed["depth"] == "auto"
    row = speed["loads"]["code"]
    assert row["plain"]["draft"] is None and row["plain"]["sources"] is None
    assert row["mtp"]["draft"] == "lookup"
    assert row["mtp"]["sources"] == {"lookup": {"rounds": 6, "proposed": [6, 4],
                                                "accepted": [4, 2],
                                                "acceptance_by_depth": [2 / 3, 0.5]}}
    assert "drafts lookup 6 rounds" in table(doc)
    bad = json.loads(json.dumps(doc))
    bad["speed"]["loads"]["code"]["mtp"]["sources"]["lookup"]["rounds"] = -1
    with pytest.raises(jsonschema.ValidationError, match="-1"):
        validate(bad, "verify_run")

    default = Fake()
    run(default, Facts("endpoint", "fake", exact_ids=True),
        VerifyOptions(loads=("code",), runs=1, max_tokens=40))
    assert {d for _, d in default.asked} == {None}, "no --draft: the target's default"


def test_verify_run_local_bundle_with_draft_lookup(built: Callable[..., Path]) -> None:
    result = _invoke("verify-run", str(built("qwen3_5")), "--loads", "code", "--runs", "1",
                     "--max-tokens", "48", "--depth", "2", "--draft", "lookup", "--json",
                     "--dtype", "float32")
    doc = json.loads(result.stdout)
    validate(doc, "verify_run")
    speed = doc["speed"]
    assert speed["draft"] == "lookup" and speed["depth"] == 2
    mtp = speed["loads"]["code"]["mtp"]
    assert mtp["draft"] == "lookup"
    assert set(mtp["sources"]) == {"lookup"} and mtp["sources"]["lookup"]["rounds"] > 0
    assert speed["loads"]["code"]["plain"]["sources"] is None
    assert next(c for c in doc["checks"] if c["name"] == "exactness")["status"] == "pass"

    headless = str(built("qwen3_5", sidecar=None))
    refused = _invoke("verify-run", headless, "--draft", "head")
    assert refused.exit_code == 2, refused.output
    assert 'error [options.no_head]: --draft "head" drafts with an MTP head' in refused.output


def test_endpoint_sends_mtp_draft(built: Callable[..., Path]) -> None:
    runner = mtpkit.load(built("qwen3_5"), dtype="float32")
    seen = _spied(runner)
    with in_thread(Server(Service(runner, "m", 2, 64), "127.0.0.1", 0, None)) as url:
        endpoint = Endpoint(url)
        assert endpoint._body(None, "x", 8, False, 2, None, "lookup")["mtp_draft"] == "lookup"
        assert "mtp_draft" not in endpoint._body(None, "x", 8, False, 2, None, None)
        text = runner.tokenizer.decode(_every_token(runner))
        answer = endpoint.ask(prompt=text, max_tokens=16, stream=True, depth=2, draft="lookup")
    assert seen[-1]["draft"] == "lookup"
    assert answer.mtp is not None and answer.mtp["draft"] == "lookup"
    assert set(answer.mtp["sources"]) == {"lookup"}


# -- generate --------------------------------------------------------------------------------

def test_generate_draft_lookup_without_a_head(built: Callable[..., Path]) -> None:
    bundle = built("qwen3_5", sidecar=None)
    runner = mtpkit.load(bundle)
    text = runner.tokenizer.decode(_every_token(runner))
    args = ["generate", str(bundle), text, "--raw", "--max-tokens", "24",
            "--depth", "2", "--dtype", "float32"]
    doc = json.loads(_invoke(*args, "--draft", "lookup", "--json").stdout)
    validate(doc, "generation")
    sources = doc["stats"]["sources"]
    assert set(sources) == {"lookup"} and sources["lookup"]["rounds"] > 0
    assert sources["lookup"]["rounds"] == doc["stats"]["verify_calls"]
    plain = json.loads(_invoke(*args[:-4], "--depth", "0", "--dtype", "float32", "--json").stdout)
    assert plain["tokens"] == doc["tokens"], "lookup drafts decode exactly like plain"
    text = _invoke(*args, "--draft", "lookup")
    assert text.exit_code == 0 and f"lookup {sources['lookup']['rounds']} rounds" in text.stderr

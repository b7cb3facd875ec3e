"""`mtpkit serve --max-batch N`: concurrent clients decoded together, each answered exactly as a
server that takes them one at a time answers it (greedy, float32), with its own usage and
finish, streamed or not; the metrics show passes of several rows."""

from __future__ import annotations

import re
import threading
import urllib.request
from typing import Any

from test_serve import serving

import mtpkit
from mtpkit.verify.endpoint import Answer, Endpoint

MESSAGES = [[{"role": "user", "content": text}] for text in (
    "Write a parser.", "Say hello.", "List three colours, then list them again.",
    "Count from one to ten.", "What is a cache?")]
# (max_tokens, depth, draft, stream): mates at other depths and sources, lengths and modes
ASKS = [(40, 2, None, True), (24, 0, None, False), (40, 3, "both", True), (32, "auto", None, False),
        (28, 1, "lookup", True)]


def _ask(url: str, messages: list[dict], ask: tuple[Any, ...]) -> Answer:
    max_tokens, depth, draft, stream = ask
    return Endpoint(url).ask(messages, max_tokens=max_tokens, stream=stream, depth=depth,
                             draft=draft, thinking=False)


def test_concurrent_clients_get_what_a_one_at_a_time_server_answers(trained) -> None:
    runner = mtpkit.load(trained["qwen3_5"][0], dtype="float32")
    with serving(runner, max_batch=1) as url:
        alone = [_ask(url, m, a) for m, a in zip(MESSAGES, ASKS, strict=True)]
    answers: list[Answer | None] = [None] * len(ASKS)

    def client(i: int) -> None:
        answers[i] = _ask(url, MESSAGES[i], ASKS[i])

    with serving(runner, max_batch=3) as url:
        threads = [threading.Thread(target=client, args=(i,)) for i in range(len(ASKS))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        with urllib.request.urlopen(url.removesuffix("/v1") + "/metrics") as response:
            metrics = response.read().decode()
    for a, b, ask in zip(alone, answers, ASKS, strict=True):
        assert b is not None
        assert (b.content, b.tokens, b.finish_reason) == (a.content, a.tokens, a.finish_reason)
        assert b.mtp["depth"] == a.mtp["depth"], ask
    rows = {m[1]: float(m[2]) for m in re.finditer(r"^mtpkit_rows_per_pass_(sum|count) (\S+)",
                                                   metrics, re.M)}
    assert rows["count"] > 0 and rows["sum"] > rows["count"], "some passes verified several rows"
    assert "mtpkit_batch_size" in metrics


def test_a_seeded_sampled_plain_request_answers_the_same_beside_a_speculative_one(built) -> None:
    """A seeded request at depth 0, sampled, got other text when a speculative request shared
    its batch ("Winter's a time of deep beauty..." alone, "Winter's embers of mystery..."
    batched): a depth-0 row of a speculative round drew one uniform more than a plain step."""
    runner = mtpkit.load(built("qwen3_5"), dtype="float32")
    sampled = {"temperature": 0.9, "seed": 11}
    plain = ([{"role": "user", "content": "Write about winter."}], (48, 0, None, False))
    mate = ([{"role": "user", "content": "Count from one to ten."}], (48, 3, None, True))

    def ask(url: str, job: tuple, extra: dict | None = None) -> Answer:
        messages, (max_tokens, depth, draft, stream) = job
        return Endpoint(url).ask(messages, max_tokens=max_tokens, stream=stream, depth=depth,
                                 draft=draft, thinking=False, extra=extra)

    with serving(runner, max_batch=1) as url:
        alone = ask(url, plain, sampled)
    got: list[Answer | None] = [None, None]

    def client(i: int) -> None:
        got[i] = ask(url, plain, sampled) if i == 0 else ask(url, mate)

    with serving(runner, max_batch=2) as url:
        threads = [threading.Thread(target=client, args=(i,)) for i in (1, 0)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
    assert got[0] is not None and got[1] is not None
    assert (got[0].content, got[0].tokens) == (alone.content, alone.tokens)
    assert got[1].mtp["depth"] == 3

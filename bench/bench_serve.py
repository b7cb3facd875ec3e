"""`mtpkit serve` for agents against its targets, on real `mtpkit serve` processes on loopback:

1. prefix cache: a second turn over a ~2,000-token shared prefix (a system prompt holding a
   source file behind a fresh nonce, a question) plus ~50 new tokens (the reply, a follow-up):
   TTFT against the first turn's, and its text against a cold server's (a second process with
   --cache-gb 0) on the same conversation;
2. concurrency: 4 clients x 5 requests at once, each waiting for its answer before the next;
   every request answered, none refused, served in arrival order (completion order equals
   send order);
3. a dropped stream: a long streamed answer whose client hangs up while another request
   waits; how long the server takes to start the waiting one, against one round of the
   dropped generation (its chunks' spacing: a chunk is one round).

    .venv/bin/python bench/bench_serve.py [--bundle out/SmolLM2-135M-mtp] [--turns 5]

With `--against OLD` (a folder holding another tree's `mtpkit/`, e.g. a `git archive` of an
older commit) only part 2 runs, on two servers of the same bundle, this tree's and OLD's,
alternately `--runs` times in one process: each pair's aggregate tokens/s ratio, their median
and spread (a paired comparison on a shared, noisy machine).

Every server runs its default depth (auto: the cost curve is measured at start-up, cached).
"""

from __future__ import annotations

import argparse
import http.client
import json
import socket
import statistics
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from common import save, summary  # noqa: E402
from mlx_lm.tokenizer_utils import load as load_tokenizer  # noqa: E402

from fixtures.serving import serve_process  # noqa: E402
from mtpkit.verify.endpoint import Endpoint  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PREFIX_TOKENS = 2000
QUESTION = "What does the first function in this file do?"
FOLLOW_UP = "Which names does it read that it does not define? List them briefly."
REPLY_TOKENS = 24  # turn 1's reply: with the follow-up and the template's glue, ~50 new tokens


def document(bundle: Path) -> str:
    """~PREFIX_TOKENS tokens of real source (decoder/rounds/session.py), whole lines."""
    tokenizer = load_tokenizer(bundle)
    lines, text = (ROOT / "decoder" / "rounds" / "session.py").read_text().splitlines(keepends=True), ""
    for line in lines:
        if len(tokenizer.encode(text + line)) > PREFIX_TOKENS:
            break
        text += line
    return text


def _turn1(doc: str) -> list[dict[str, str]]:
    system = f"[session {uuid.uuid4().hex[:12]}] You review code. The file:\n\n{doc}"
    return [{"role": "system", "content": system}, {"role": "user", "content": QUESTION}]


def prefix_cache(warm: Endpoint, cold: Endpoint, doc: str, turns: int,
                 max_tokens: int) -> dict[str, Any]:
    """Each repetition a fresh nonce: turn 1 (cold everywhere), turn 2 on the caching server,
    turn 2 on the cold server (its reference text)."""
    rows = []
    ask = {"max_tokens": max_tokens, "stream": True}
    warm.ask([{"role": "user", "content": "warm-up"}], **ask)
    cold.ask([{"role": "user", "content": "warm-up"}], **ask)
    for _ in range(turns):
        turn1 = _turn1(doc)
        first = warm.ask(turn1, max_tokens=REPLY_TOKENS, stream=True)
        turn2 = [*turn1, {"role": "assistant", "content": first.content},
                 {"role": "user", "content": FOLLOW_UP}]
        second, reference = warm.ask(turn2, **ask), cold.ask(turn2, **ask)
        rows.append({"prompt_tokens_1": first.prompt_tokens, "prompt_tokens_2": second.prompt_tokens,
                     "cached_tokens_2": (second.mtp or {}).get("cached_tokens"),
                     "ttft_1_s": first.ttft_s, "ttft_2_s": second.ttft_s,
                     "ttft_2_cold_s": reference.ttft_s,
                     "server_ttft_1_s": (first.mtp or {}).get("ttft_s"),
                     "server_ttft_2_s": (second.mtp or {}).get("ttft_s"),
                     "ratio": second.ttft_s / first.ttft_s if first.ttft_s and second.ttft_s else None,
                     "identical": (second.content, second.reasoning) == (reference.content,
                                                                        reference.reasoning),
                     "tokens_2": second.tokens,
                     "peak_memory_bytes": max((a.mtp or {}).get("peak_memory_bytes") or 0
                                              for a in (first, second))})
    return {"rows": rows,
            "ttft_1_s": summary([r["ttft_1_s"] for r in rows]),
            "ttft_2_s": summary([r["ttft_2_s"] for r in rows]),
            "ttft_2_cold_s": summary([r["ttft_2_cold_s"] for r in rows]),
            "ratio": summary([r["ratio"] for r in rows]),
            "new_tokens": summary([r["prompt_tokens_2"] - r["cached_tokens_2"] for r in rows]),
            "identical": sum(r["identical"] for r in rows), "n": len(rows),
            "peak_memory_bytes": max(r["peak_memory_bytes"] for r in rows)}


def concurrency(url: str, clients: int, each: int, max_tokens: int) -> dict[str, Any]:
    """`clients` threads, each sending `each` requests one after another. The server numbers
    requests as they arrive (X-Mtpkit-Arrival); first in, first out means they are answered in
    that order."""
    done: list[tuple[float, int, float]] = []  # (answered, arrival number, latency)
    produced: list[int] = []  # completion tokens per answer
    depths: dict[str, int] = {}  # rounds per depth (plain steps at "0"), summed over answers
    errors: list[str] = []
    lock = threading.Lock()
    start = threading.Barrier(clients)

    def client(c: int) -> None:
        start.wait()
        for r in range(each):
            sent = time.perf_counter()
            try:
                conn, _ = _post(url, {"prompt": f"[{uuid.uuid4().hex[:8]}] Client {c} asks "
                                      f"question {r}: what is a queue?", "max_tokens": max_tokens})
                response = conn.getresponse()
                doc = json.loads(response.read())
                assert response.status == 200, doc
                tokens = doc["usage"]["completion_tokens"]
                assert tokens, "no usage"
                mtp = doc["usage"].get("mtp") or {}
                arrival = int(response.getheader("X-Mtpkit-Arrival"))
            except Exception as exc:  # noqa: BLE001 (every failure is a finding here)
                with lock:
                    errors.append(f"client {c} request {r}: {exc}")
                continue
            answered = time.perf_counter()
            with lock:
                done.append((answered, arrival, answered - sent))
                produced.append(tokens)
                for d, n in (mtp.get("depths") or {}).items():
                    depths[d] = depths.get(d, 0) + n

    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    began = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - began
    order = [arrival for _, arrival, _ in sorted(done)]
    return {"clients": clients, "each": each, "answered": len(done), "errors": errors,
            "arrival_order_kept": order == sorted(order), "answer_order": order,
            "wall_s": wall, "tokens": sum(produced), "tok_s": sum(produced) / wall,
            "depths": dict(sorted(depths.items(), key=lambda kv: int(kv[0]))),
            "latency_s": summary([d[2] for d in done]) if done else None}


def _post(url: str, body: dict) -> tuple[http.client.HTTPConnection, socket.socket]:
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=300)
    conn.request("POST", "/v1/completions", json.dumps(body).encode(),
                 {"Content-Type": "application/json"})
    assert conn.sock is not None
    return conn, conn.sock


def dropped_stream(url: str, rounds_before_drop: int) -> dict[str, Any]:
    """A long stream dropped after some rounds while a request waits; the wait after the drop
    against the dropped stream's own round time."""
    long, sock = _post(url, {"prompt": f"[{uuid.uuid4().hex[:8]}] Write a long essay on queues.",
                             "max_tokens": 2048, "stream": True})
    response = long.getresponse()
    times = []
    while len(times) < rounds_before_drop:
        line = response.fp.readline()
        if line.startswith(b"data: {"):
            times.append(time.perf_counter())
    waiting, _ = _post(url, {"prompt": "[waiting] Name a queue.", "max_tokens": 8,
                             "stream": True})
    time.sleep(0.5)  # the waiting request is in line
    sock.shutdown(socket.SHUT_RDWR)
    sock.close()
    dropped = time.perf_counter()
    answer = waiting.getresponse()
    first = None
    usage: dict[str, Any] = {}
    for line in answer.fp:
        if line.startswith(b"data: {"):
            doc = json.loads(line[6:])
            first = first or time.perf_counter()
            usage = doc.get("usage") or usage
    assert first is not None and usage, "the waiting request was not answered"
    rounds = [b - a for a, b in zip(times[1:], times[2:], strict=False)]
    server_ttft = usage["mtp"]["ttft_s"]
    freed = first - dropped - server_ttft  # from the hang-up to the waiting request's prefill
    return {"round_s": summary(rounds), "freed_after_drop_s": freed,
            "waiting_ttft_server_s": server_ttft,
            "freed_in_rounds": freed / statistics.median(rounds)}


def paired(bundle: Path, old: Path, runs: int, options: list[str]) -> dict[str, Any]:
    """Part 2 on this tree's server and OLD's, alternately (see the module's doc)."""
    arms: dict[str, list[dict[str, Any]]] = {"new": [], "old": []}
    env = {"PYTHONPATH": str(old.resolve())}
    with serve_process(bundle, "--cache-gb", "2", *options) as new_url, \
            serve_process(bundle, "--cache-gb", "2", *options, env=env) as old_url:
        for url in (new_url, old_url):  # warm-up, not counted
            concurrency(url, 4, 1, 32)
        for run in range(runs):
            order = (("new", new_url), ("old", old_url))
            for arm, url in order if run % 2 == 0 else order[::-1]:
                arms[arm].append(concurrency(url, 4, 5, 32))
                print(f"run {run + 1}/{runs} {arm}: {arms[arm][-1]['tok_s']:.1f} tok/s, "
                      f"depths {arms[arm][-1]['depths']}", file=sys.stderr)
    ratios = [n["tok_s"] / o["tok_s"] for n, o in zip(arms["new"], arms["old"], strict=True)]
    return {"against": str(old), "runs": runs,
            "tok_s": {arm: summary([r["tok_s"] for r in rs]) for arm, rs in arms.items()},
            "ratio": {**summary(ratios), "max": max(ratios), "each": ratios},
            "errors": sum(len(r["errors"]) for rs in arms.values() for r in rs),
            "arms": arms}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bundle", type=Path, default=ROOT / "out" / "SmolLM2-135M-mtp")
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                        help="float32 by default: on MLX's CPU backend with OpenBLAS a bf16 "
                        "prefill of 2,000 tokens takes ~7x longer")
    parser.add_argument("--against", type=Path,
                        help="a folder holding another tree's mtpkit/: part 2 only, paired")
    parser.add_argument("--runs", type=int, default=5, help="pairs, with --against")
    args = parser.parse_args()
    options = ["--dtype", args.dtype]
    if args.against is not None:
        pair = paired(args.bundle, args.against, args.runs, options)
        path = save(f"serve-pair-{args.dtype}", {"bundle": str(args.bundle), **pair})
        t, r = pair["tok_s"], pair["ratio"]
        print(f"4 clients x 5 requests: this tree {t['new']['median']:.1f} tok/s, "
              f"{args.against} {t['old']['median']:.1f} (medians of {args.runs}); paired "
              f"ratio {r['median']:.3f} (min {r['min']:.3f}, max {r['max']:.3f}); errors "
              f"{pair['errors']}; written {path}")
        return
    doc = document(args.bundle)
    with serve_process(args.bundle, "--cache-gb", "2", *options) as url, \
            serve_process(args.bundle, "--cache-gb", "0", *options) as cold_url:
        print("prefix cache ...", file=sys.stderr)
        prefix = prefix_cache(Endpoint(url), Endpoint(cold_url), doc, args.turns, args.max_tokens)
        print("concurrency ...", file=sys.stderr)
        together = concurrency(url, 4, 5, 32)
        print("dropped stream ...", file=sys.stderr)
        drop = dropped_stream(url, 8)
        metrics = Endpoint(url)._connect()
        metrics.request("GET", "/metrics")
        text = metrics.getresponse().read().decode()
    result = {"bundle": str(args.bundle), "dtype": args.dtype,
              "prefix_cache": prefix, "concurrency": together, "dropped_stream": drop,
              "metrics_excerpt": [line for line in text.splitlines()
                                  if line.startswith(("mtpkit_requests_total",
                                                      "mtpkit_prefix_cache", "mtpkit_cached"))]}
    path = save(f"serve-{args.dtype}", result)
    p = prefix
    print(f"prefix: turn 1 TTFT {p['ttft_1_s']['median'] * 1000:.0f} ms, turn 2 "
          f"{p['ttft_2_s']['median'] * 1000:.0f} ms (P95 {p['ttft_2_s']['p95'] * 1000:.0f}), "
          f"cold server {p['ttft_2_cold_s']['median'] * 1000:.0f} ms; ratio "
          f"{p['ratio']['median']:.3f} (P95 {p['ratio']['p95']:.3f}); new tokens "
          f"{p['new_tokens']['median']:.0f}; identical {p['identical']}/{p['n']}; MLX peak "
          f"{p['peak_memory_bytes'] / 2**20:.0f} MiB")
    print(f"concurrency: {together['answered']}/20 answered, errors {len(together['errors'])}, "
          f"arrival order kept {together['arrival_order_kept']}")
    print(f"dropped stream: freed after {drop['freed_after_drop_s'] * 1000:.0f} ms, one round "
          f"{drop['round_s']['median'] * 1000:.0f} ms ({drop['freed_in_rounds']:.2f} rounds)")
    print(f"written {path}")


if __name__ == "__main__":
    main()

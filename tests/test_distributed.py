"""MTP on a trunk sharded over two processes (127.0.0.1, MLX's ring backend), exact.

Each world runs this file as its worker on both ranks: rank 0 generates (greedy MTP, plain,
context drafts beside the head, seeded sampling) over a LeaderTrunk, rank 1 follows; both write
what they hold. Tiny float32 fixtures: llama with 4 query / 2 KV heads and Qwen3.5 with 2 KV and
2 linear key heads (tensor), the recurrent and MLA families (pipeline). Checked: every token
equals the single-process run's, greedy MTP equals plain, the follower's cache holds exactly
rank 0's committed tokens (offset included), and each rank holds half the KV heads (tensor) or
only its own layers (pipeline). Then the failures: --shard alone, indivisible heads, unsupported
families, a rank that dies (the other exits PEER_LOST in seconds), and the CLI under mlx.launch.
"""

from __future__ import annotations

import json
import os
import re
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from unittest import mock

import pytest

from fixtures.serving import interruptible
from mtpkit.decoder.sharded.peerwatch import PEER_LOST

WORKER_TIMEOUT_S = 240
PROMPT = [5 + (i * 37) % 200 for i in range(20)] * 2  # 40 tokens: the prefill takes 2 arrays
LONG = [5 + (i * 53) % 500 for i in range(2100)]  # 2 prefill chunks, the first without logits
JOBS = [{"depth": 2, "max_tokens": 24},
        {"depth": 0, "max_tokens": 24},
        {"depth": 3, "max_tokens": 20, "draft": "both"},
        {"depth": 2, "max_tokens": 20, "temperature": 0.8, "seed": 7},
        {"depth": 0, "max_tokens": 3, "long": True}]


def prompt(job: dict[str, Any]) -> tuple[list[int], dict[str, Any]]:
    """A job's prompt and its generate options."""
    return (LONG if job.get("long") else PROMPT), {k: v for k, v in job.items() if k != "long"}
# family -> config changes for a split of the heads over 2 ranks
TENSOR = {"llama": {"num_attention_heads": 4, "num_key_value_heads": 2},
          "qwen3_5": {"num_key_value_heads": 2, "linear_num_key_heads": 2},
          "qwen3_5_moe": {"num_key_value_heads": 2, "linear_num_key_heads": 2},
          "deepseek_v3": {}}
PIPELINE = ("qwen3_5", "qwen3_5_moe", "qwen3_next", "deepseek_v3")


# -- the worker (both ranks run it) ---------------------------------------------------------

def worker(bundle: str, mode: str, rollback: str, out: str) -> None:
    from mlx.utils import tree_flatten

    from mtpkit.decoder.runner import load
    from mtpkit.decoder.sharded import distributed

    runner = load(bundle, dtype="float32", shard=mode, rollback=rollback)
    record: dict[str, Any] = {}
    if distributed.is_follower(runner):
        follower = distributed.follow(runner)
        cache = follower.cache
        record |= {"code": follower.code, "head": False,
                   "transcripts": [[t.tokens, t.offset] for t in follower.transcripts]}
    else:
        results = []
        for job in JOBS:
            ids, options = prompt(job)
            result = runner.generate(ids, **options)
            results.append([result.tokens, result.finish_reason,
                            distributed.committed(runner.trunk.cache)])
        cache = runner.trunk.cache
        distributed.finish(runner)
        record |= {"results": results, "head": runner.head is not None}
    inner = runner.trunk.inner
    record |= {
        "layers": [i for i, layer in enumerate(inner.layers) if layer is not None],
        "kv_heads": sorted({c.keys.shape[1] for c in cache
                            if getattr(c, "keys", None) is not None}),
        "layer_bytes": sum(v.nbytes for _, v in tree_flatten(inner.parameters())),
    }
    (Path(out) / f"rank{os.environ['MLX_RANK']}.json").write_text(json.dumps(record))


# -- launching ------------------------------------------------------------------------------

def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def hostfile(tmp: Path, ranks: int = 2) -> Path:
    path = tmp / "hosts.json"
    path.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in free_ports(ranks)]))
    return path


@contextmanager
def world(tmp: Path, argv: list[str], ranks: int = 2) -> Iterator[list[subprocess.Popen]]:
    """`ranks` processes of argv with MLX_RANK / MLX_HOSTFILE set; every one still running
    at the end is killed by its pid."""
    hosts = hostfile(tmp, ranks)
    procs = []
    for rank in range(ranks):
        env = {**os.environ, "MLX_RANK": str(rank), "MLX_HOSTFILE": str(hosts),
               "MTPKIT_CONNECT_TIMEOUT": "60", "PYTHONFAULTHANDLER": "1"}
        procs.append(subprocess.Popen(argv, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True, cwd=tmp,
                                      preexec_fn=interruptible))
    try:
        yield procs
    finally:
        for p in procs:
            if p.poll() is None:
                os.kill(p.pid, signal.SIGKILL)
            p.wait()


def finish(procs: list[subprocess.Popen], timeout: float = WORKER_TIMEOUT_S
           ) -> list[tuple[int, str, str]]:
    """Each process's (exit code, stdout, stderr). One still running at the deadline is
    aborted, which makes it print every thread's Python stack (PYTHONFAULTHANDLER), and the
    test fails with that."""
    deadline = time.monotonic() + timeout
    outs = []
    for rank, p in enumerate(procs):
        try:
            out, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            masks = _signal_masks(p.pid)
            os.kill(p.pid, signal.SIGABRT)
            _, err = p.communicate()
            raise AssertionError(f"rank {rank} still ran after {timeout:g} s ({masks}):\n"
                                 f"{err[-6000:]}") from None
        outs.append((p.returncode, out, err))
    return outs


def _signal_masks(pid: int) -> str:
    """Which signals each thread of `pid` blocks, and which the process ignores or has
    pending (Linux), for a process that would not end."""
    out = []
    for status in sorted(Path(f"/proc/{pid}/task").glob("*/status")):
        try:
            fields = dict(line.split(":\t", 1) for line in status.read_text().splitlines()
                          if ":\t" in line)
        except OSError:
            continue
        out.append(f"{fields.get('Name', '?').strip()}: blk {fields.get('SigBlk', '?').strip()}"
                   f" ign {fields.get('SigIgn', '?').strip()} pnd {fields.get('ShdPnd', '?').strip()}")
    return "; ".join(out) or "no /proc"


def run_world(tmp: Path, bundle: Path, mode: str, rollback: str = "record") -> list[dict]:
    """Both ranks' records of one world running the worker."""
    with world(tmp, [sys.executable, __file__, "worker", str(bundle), mode, rollback,
                     str(tmp)]) as procs:
        outs = finish(procs)
    for rank, (code, _, err) in enumerate(outs):
        assert code == 0, f"rank {rank} exited {code}: {err[-3000:]}"
    return [json.loads((tmp / f"rank{rank}.json").read_text()) for rank in range(2)]


def build(family: str, out: Path, changes: dict[str, Any]) -> Path:
    """The factory's tiny bundle of `family` with its config changed (heads that split)."""
    from fixtures import configs
    from fixtures.factory import build_mlx

    config = configs.config_for(family)
    target = config.get("text_config", config)
    target.update(changes)
    with mock.patch.dict(configs.CONFIGS, {family: config}):
        return build_mlx(family, out, quantize=False)


# -- tests ----------------------------------------------------------------------------------

CASES = [*(("tensor", f) for f in TENSOR), *(("pipeline", f) for f in PIPELINE)]


@pytest.fixture(scope="module")
def bundles(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], Path]:
    """(mode, family) -> a float32-ready bundle whose heads split over 2 ranks."""
    root = tmp_path_factory.mktemp("sharded")
    made: dict[tuple[str, ...], Path] = {}
    out = {}
    for mode, family in CASES:
        changes = TENSOR[family] if mode == "tensor" else {}
        key = (family, *sorted(changes))
        if key not in made:
            made[key] = build(family, root / f"{family}-{len(made)}", changes)
        out[mode, family] = made[key]
    return out


def single(bundle: Path, rollback: str = "record") -> list[list[int]]:
    from mtpkit.decoder.runner import load

    runner = load(bundle, dtype="float32", rollback=rollback)
    return [runner.generate(prompt(job)[0], **prompt(job)[1]).tokens for job in JOBS]


@pytest.mark.parametrize(("mode", "family"), CASES)
def test_two_ranks_decode_exactly(mode: str, family: str, bundles: dict, tmp_path: Path) -> None:
    bundle = bundles[mode, family]
    leader, follower = run_world(tmp_path, bundle, mode)
    expected = single(bundle)
    tokens = [r[0] for r in leader["results"]]
    assert tokens == expected  # greedy MTP, plain, lookup beside the head, seeded sampling
    assert tokens[0][:20] == tokens[1][:20] == tokens[2][:20]  # greedy MTP == plain
    assert leader["head"] == (family != "llama") and not follower["head"]
    assert follower["code"] == 0
    # the follower's cache held exactly what rank 0 committed, at rank 0's offset
    for job, (ids, finish_reason, offset), (held, held_offset) in zip(
            JOBS, leader["results"], follower["transcripts"], strict=True):
        fed = prompt(job)[0]
        assert finish_reason == "length"
        assert offset == held_offset == len(held) == len(fed) + len(ids) - 1
        assert held == (fed + ids)[:offset]
    whole = _whole(bundle)
    if mode == "tensor":
        assert leader["layers"] == follower["layers"] == list(range(whole["layers"]))
        kv = whole["kv_heads"]
        assert leader["kv_heads"] == follower["kv_heads"] == ([kv // 2] if kv > 1 else [kv])
        assert leader["layer_bytes"] < whole["layer_bytes"]
    else:
        held = sorted(leader["layers"] + follower["layers"])
        assert held == list(range(whole["layers"]))
        assert leader["layers"][0] > follower["layers"][-1]  # rank 0 runs the last layers
        assert leader["layer_bytes"] + follower["layer_bytes"] < 2 * whole["layer_bytes"]


def _whole(bundle: Path) -> dict[str, int]:
    """What one process holds of the bundle: layers, KV heads of its attention caches
    (MLA's latent cache counts 1), bytes of its layers."""
    from mlx.utils import tree_flatten

    from mtpkit.decoder.runner import load

    runner = load(bundle, dtype="float32")
    cache = runner.trunk.make_cache()
    runner.trunk(mx_tokens(PROMPT[:4]), cache)
    heads = {c.keys.shape[1] for c in cache if getattr(c, "keys", None) is not None}
    inner = runner.trunk.inner
    return {"layers": len(inner.layers), "kv_heads": max(heads),
            "layer_bytes": sum(v.nbytes for _, v in tree_flatten(inner.parameters()))}


def mx_tokens(ids: list[int]) -> Any:
    import mlx.core as mx

    return mx.array(ids)[None]


def test_replay_rollback_over_remote_recurrent_layers(bundles: dict, tmp_path: Path) -> None:
    """Pipeline Qwen3.5 with --rollback replay: rank 0 restores a snapshot and replays the
    kept tokens, and the follower's recurrent layers follow."""
    bundle = bundles["pipeline", "qwen3_5"]
    leader, follower = run_world(tmp_path, bundle, "pipeline", "replay")
    assert [r[0] for r in leader["results"]] == single(bundle, "replay") == single(bundle)
    assert [t[1] for t in follower["transcripts"]] == [r[2] for r in leader["results"]]


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "mtpkit.cli", *args]


def test_shard_needs_a_world(bundles: dict) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLX_")}
    done = subprocess.run(cli("generate", str(bundles["tensor", "llama"]), "hi", "--shard",
                              "tensor"), capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 2
    assert "error [distributed.single_process]" in done.stderr and "mlx.launch" in done.stderr
    assert "Traceback" not in done.stderr


def test_indivisible_heads_are_refused_on_every_rank(bundles: dict, tmp_path: Path) -> None:
    """The factory's llama has 1 KV head: 2 ranks cannot split it (mlx-lm would give each
    rank half a head). Every rank says so in one line and exits 2."""
    from fixtures.factory import build_mlx

    bundle = build_mlx("llama", tmp_path / "llama", quantize=False)
    with world(tmp_path, cli("generate", str(bundle), "hi", "--raw", "--shard", "tensor")
               ) as procs:
        outs = finish(procs, 120)
    for rc, _, err in outs:
        assert rc == 2, err
        assert "error [distributed.indivisible]: 2 ranks do not divide num_key_value_heads=1 "\
               "of this llama trunk" in err and "Traceback" not in err


class _Group:
    """A stand-in world of `n` ranks for the checks made before any collective."""

    def __init__(self, n: int, rank: int = 0) -> None:
        self.n, self.r = n, rank

    def size(self) -> int:
        return self.n

    def rank(self) -> int:
        return self.r


def _model(family: str, **changes: Any) -> Any:
    from mlx_lm.utils import _get_classes

    from fixtures import configs

    config = configs.config_for(family)
    config.get("text_config", config).update(changes)
    model_cls, args_cls = _get_classes(config)
    return model_cls(args_cls.from_dict(config))


@pytest.mark.parametrize(("family", "changes", "ranks", "names"), [
    ("llama", {}, 2, "num_key_value_heads=1"),
    ("llama", {"num_attention_heads": 4, "num_key_value_heads": 2}, 4, "num_key_value_heads=2"),
    ("llama", {"num_attention_heads": 4, "num_key_value_heads": 2}, 3,
     "num_attention_heads=4, num_key_value_heads=2, intermediate_size=128"),
    ("qwen3_5", {}, 2, "linear_num_key_heads=1"),
    ("qwen3_5", {"linear_num_key_heads": 2}, 4,
     "num_attention_heads=2, linear_num_key_heads=2, linear_num_value_heads=2"),
    ("deepseek_v3", {}, 4, "num_attention_heads=2"),
])
def test_indivisible_dims_are_named(family: str, changes: dict, ranks: int, names: str) -> None:
    from mtpkit.decoder.sharded.sharding import check_tensor
    from mtpkit.loaders.findings import UserError

    with pytest.raises(UserError, match="do not divide") as exc:
        check_tensor(_model(family, **changes), ranks)
    assert exc.value.code == "distributed.indivisible"
    assert f"{ranks} ranks do not divide {names} of this" in str(exc.value)


@pytest.mark.parametrize(("family", "changes", "ranks"), [
    ("qwen3_5", {"linear_num_key_heads": 2}, 2),  # 1 KV head: mlx-lm repeats it per rank
    ("deepseek_v3", {"num_key_value_heads": 3}, 2),  # MLA: no KV heads to split
    ("llama", {"num_attention_heads": 4, "num_key_value_heads": 2}, 2),
])
def test_divisible_dims_pass(family: str, changes: dict, ranks: int) -> None:
    from mtpkit.decoder.sharded.sharding import check_tensor

    check_tensor(_model(family, **changes), ranks)


@pytest.mark.parametrize(("family", "mode", "says"), [
    ("llama", "pipeline", "cannot pipeline llama"),
    ("mimo", "tensor", "cannot split mimo tensor-parallel"),
    ("mimo", "pipeline", "cannot pipeline mimo"),
    ("qwen3_next", "tensor", "cannot split qwen3_next tensor-parallel"),
    ("deepseek_v3", "pipeline-3", "3 pipeline stages need at least 3 layers; this trunk has 2"),
])
def test_unsupported_splits_are_refused(family: str, mode: str, says: str) -> None:
    from mtpkit.decoder.model.trunk import Trunk
    from mtpkit.decoder.sharded import sharding
    from mtpkit.loaders.findings import UserError

    model = _model(family)
    with pytest.raises(UserError) as exc:
        if mode == "tensor":
            sharding.shard_tensor(model, _Group(2))
        else:
            sharding.shard_pipeline(Trunk(model), _Group(int(mode[-1]) if "-" in mode else 2))
    assert says in str(exc.value)
    assert exc.value.code == ("distributed.indivisible" if "-" in mode
                              else "distributed.unsupported")


def test_a_rank_that_never_joins_times_out(bundles: dict, tmp_path: Path) -> None:
    hosts = hostfile(tmp_path)
    env = {**os.environ, "MLX_RANK": "0", "MLX_HOSTFILE": str(hosts),
           "MTPKIT_CONNECT_TIMEOUT": "3"}
    start = time.monotonic()
    done = subprocess.run(cli("generate", str(bundles["tensor", "llama"]), "hi", "--shard",
                              "tensor"), capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == -signal.SIGKILL  # mx.distributed.init holds the GIL: killed
    assert done.stderr.startswith("error [distributed.connect_timeout]: not every rank joined "
                                  "within 3 s")
    assert time.monotonic() - start < 60


@pytest.mark.parametrize("victim", [1, 0])
def test_a_rank_that_dies_ends_the_other(victim: int, bundles: dict, tmp_path: Path) -> None:
    """Mid-generation, one rank is killed: the other exits PEER_LOST with one line."""
    argv = cli("generate", str(bundles["tensor", "qwen3_5"]), "hello", "--raw", "--depth", "2",
               "--max-tokens", str(1 << 20), "--dtype", "float32", "--shard", "tensor")
    with world(tmp_path, argv) as procs:
        _wait_for_output(procs[0], 120)  # rank 0 streams text: the world is decoding
        os.kill(procs[victim].pid, signal.SIGKILL)
        start = time.monotonic()
        rc, _, err = finish([procs[1 - victim]], 60)[0]
        assert time.monotonic() - start < 30
    assert rc == PEER_LOST, err
    assert "error [distributed.peer_lost]" in err and "Traceback" not in err


def test_ctrl_c_stops_a_sharded_generation_between_rounds(bundles: dict, tmp_path: Path
                                                          ) -> None:
    """Ctrl-C on rank 0 mid-generation: the round in flight ends, the followers are told, and
    every rank exits 1 in step (a pass cut in the middle left the followers in collectives
    rank 0 never joined: both reported a lost peer)."""
    argv = cli("generate", str(bundles["tensor", "qwen3_5"]), "hello", "--raw", "--depth", "2",
               "--max-tokens", str(1 << 20), "--dtype", "float32", "--shard", "tensor")
    with world(tmp_path, argv) as procs:
        _wait_for_output(procs[0], 120)
        os.kill(procs[0].pid, signal.SIGINT)
        outs = finish(procs, 60)
    assert [code for code, _, _ in outs] == [1, 1], [err[-2000:] for _, _, err in outs]
    leader_err = outs[0][2]
    assert re.search(r"interrupted after \d+ tokens", leader_err), leader_err
    for _, _, err in outs:
        assert "peer_lost" not in err and "Traceback" not in err and "Aborted" not in err, err


def _wait_for_output(proc: subprocess.Popen, timeout: float) -> None:
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    assert ready and os.read(proc.stdout.fileno(), 1), "rank 0 printed nothing"


def test_serve_sharded(bundles: dict, tmp_path: Path) -> None:
    """serve --shard: rank 0 answers HTTP like one process would, the follower runs its
    passes; on Ctrl-C both exit 0."""
    import urllib.request

    from mtpkit.decoder.runner import load

    bundle = bundles["tensor", "qwen3_5"]
    argv = cli("serve", str(bundle), "--port", "0", "--depth", "2", "--dtype", "float32",
               "--shard", "tensor")
    body = json.dumps({"prompt": "hello", "max_tokens": 12, "temperature": 0}).encode()
    with world(tmp_path, argv) as procs:
        port = _serving_port(procs[0], 120)
        answers = []
        for _ in range(2):  # two requests: the second one starts a new cache on both ranks
            request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                             {"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=120) as response:
                answers.append(json.loads(response.read()))
        os.kill(procs[0].pid, signal.SIGINT)
        outs = finish(procs, 60)
    assert [code for code, _, _ in outs] == [0, 0], [err[-2000:] for _, _, err in outs]
    expected = load(bundle, dtype="float32").generate("hello", 12, depth=2)
    for answer in answers:
        assert answer["choices"][0]["text"] == expected.text
        assert answer["usage"]["completion_tokens"] == len(expected.tokens)


def _serving_port(proc: subprocess.Popen, timeout: float) -> int:
    """The port rank 0's serve announces on stderr."""
    assert proc.stderr is not None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stderr], [], [], deadline - time.monotonic())
        line = proc.stderr.readline() if ready else ""
        if "serving" in line:
            return int(line.split("http://127.0.0.1:")[1].split("/")[0])
        assert line or proc.poll() is None, "rank 0 exited before serving"
    raise AssertionError("rank 0 never served")


def test_cli_under_mlx_launch(bundles: dict, tmp_path: Path) -> None:
    """The CLI itself under mlx.launch: one JSON document (rank 0's), tokens equal to the
    single-process run; the followers print nothing."""
    bundle = str(bundles["pipeline", "qwen3_5"])
    args = ["generate", bundle, "hello world", "--raw", "--dtype", "float32", "--depth", "2",
            "--max-tokens", "16", "--json"]
    alone = subprocess.run(cli(*args), capture_output=True, text=True, timeout=120)
    assert alone.returncode == 0, alone.stderr
    launcher = Path(sys.executable).parent / "mlx.launch"
    done = subprocess.run([str(launcher), "--hosts", "127.0.0.1", "-n", "2", "--backend", "ring",
                           "--starting-port", str(free_ports(1)[0]), "--",
                           *cli(*args, "--shard", "pipeline")],
                          capture_output=True, text=True, timeout=WORKER_TIMEOUT_S, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)  # exactly one document: only rank 0 printed
    assert doc["tokens"] == json.loads(alone.stdout)["tokens"]
    assert doc["stats"]["verify_calls"] > 0


if __name__ == "__main__" and sys.argv[1:2] == ["worker"]:
    worker(*sys.argv[2:6])

"""A trunk split over the ranks of an MLX distributed world, the way mlx-lm's sharded_load does.

Tensor parallel: `model.shard(group)` splits every layer's heads and MLP columns over the ranks,
each of which then holds 1/N of the KV heads. mlx-lm's vocabulary-parallel lm_head (Qwen3.5) is
put back whole: the MTP head drafts on rank 0 alone, and a split unembedding would need a
collective in every draft step. Pipeline: `pipeline(group)` gives rank 0 the last layers and
rank N-1 the first; a rank keeps only its own layers (and their recorders). Weights are loaded
lazily, so a rank reads only what it keeps.
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mtpkit.decoder.model.trunk import Trunk
from mtpkit.decoder.sharded import peerwatch
from mtpkit.loaders.families import KV_REPEATING
from mtpkit.loaders.findings import UserError

MODES = ("tensor", "pipeline")
CONNECT_TIMEOUT_S = 300.0  # MTPKIT_CONNECT_TIMEOUT overrides: seconds to wait for every rank
# Run beside mx.distributed.init: kills the process (argv 1) unless its stdin closes in time.
WATCHDOG = """import os, select, signal, sys
if not select.select([sys.stdin], [], [], float(sys.argv[2]))[0]:
    sys.stderr.write(sys.argv[3]); sys.stderr.flush(); os.kill(int(sys.argv[1]), signal.SIGKILL)
"""
# Dimensions mlx-lm's shard() splits N ways (where the model has them).
SPLIT_DIMS = ("num_attention_heads", "num_key_value_heads", "linear_num_key_heads",
              "linear_num_value_heads", "intermediate_size", "moe_intermediate_size",
              "shared_expert_intermediate_size")


def join(mode: str) -> mx.distributed.Group:
    """The world this process was launched into (mlx.launch, or MLX_RANK and MLX_HOSTFILE).
    A rank that never shows up would block forever in mx.distributed.init, which holds the
    GIL: a watchdog process ends this one after the connect timeout, with one line. Once
    joined, a peer watch (peerwatch.py) ends this rank if a peer closes its connection."""
    if mode not in MODES:
        raise ValueError(f"shard must be one of {', '.join(MODES)}")
    limit = float(os.environ.get("MTPKIT_CONNECT_TIMEOUT", CONNECT_TIMEOUT_S))
    message = (f"error [distributed.connect_timeout]: not every rank joined within {limit:g} s"
               "\n  hint: start every rank (mlx.launch does), check the hostfile's addresses, "
               "or raise MTPKIT_CONNECT_TIMEOUT\n")
    watchdog = subprocess.Popen([sys.executable, "-c", WATCHDOG, str(os.getpid()), str(limit),
                                 message], stdin=subprocess.PIPE)
    before = peerwatch.socket_fds()
    try:
        group = mx.distributed.init()
    except RuntimeError as exc:  # e.g. an unreadable hostfile
        raise UserError("distributed.init_failed", f"MLX distributed could not start: {exc}",
                        "check MLX_HOSTFILE (a JSON list of [\"ip:port\"] per rank) or start "
                        "under mlx.launch") from None
    finally:
        assert watchdog.stdin is not None
        watchdog.stdin.close()  # joined (or failed): the watchdog exits
        watchdog.wait()
    if group.size() < 2:
        raise UserError("distributed.single_process", f"--shard {mode} needs 2 or more ranks; "
                        "this process runs alone", "start it under mlx.launch (e.g. mlx.launch "
                        "--hostfile hosts.json --backend ring -- mtpkit generate ... --shard "
                        f"{mode})")
    peerwatch.watch(peerwatch.connections(peerwatch.socket_fds() - before))
    return group


def text_model(model: nn.Module) -> nn.Module:
    return getattr(model, "language_model", model)


def check_tensor(model: nn.Module, ranks: int) -> None:
    """Refuse, naming the dimensions, a rank count that does not split the heads evenly
    (mlx-lm would silently split a head in two or fail deep inside)."""
    text, kind = text_model(model), model.model_type
    if not hasattr(model, "shard"):
        raise UserError("distributed.unsupported", f"mlx-lm cannot split {kind} "
                        "tensor-parallel", "use --shard pipeline" if _pipelines(model) else
                        "this family runs on one machine only")
    args = text.args
    bad = []
    for name in SPLIT_DIMS:
        value = getattr(args, name, None)
        if not isinstance(value, int) or value % ranks == 0:
            continue
        if name == "num_key_value_heads" and (
                hasattr(args, "kv_lora_rank")  # MLA: one latent cache, no KV heads to split
                or kind in KV_REPEATING and ranks % value == 0):
            continue
        bad.append(f"{name}={value}")
    if "lm_head" in text and args.vocab_size % ranks:  # mlx-lm asserts before sharding it
        bad.append(f"vocab_size={args.vocab_size}")
    if bad:
        raise UserError("distributed.indivisible", f"{ranks} ranks do not divide "
                        f"{', '.join(bad)} of this {kind} trunk",
                        "use a rank count that divides them, or --shard pipeline")


def _pipelines(model: nn.Module) -> bool:
    return hasattr(text_model(model).model, "pipeline")


def shard_tensor(model: nn.Module, group: mx.distributed.Group) -> None:
    """mlx-lm's tensor-parallel split, with the lm_head kept whole on every rank."""
    check_tensor(model, group.size())
    text = text_model(model)
    lm_head = text.get("lm_head")
    model.shard(group)
    if lm_head is not None:
        text.lm_head = lm_head
        if hasattr(text, "sharding_group"):
            text.sharding_group = None


def shard_pipeline(trunk: Trunk, group: mx.distributed.Group) -> None:
    """mlx-lm's pipeline split; the trunk's recorders shrink to this rank's layers. Called
    after the MTP head is built (it copies a layer class the split replaces by None)."""
    inner = trunk.inner
    if not _pipelines(trunk.model):
        raise UserError("distributed.unsupported", f"mlx-lm cannot pipeline "
                        f"{trunk.model.model_type}", "use --shard tensor"
                        if hasattr(trunk.model, "shard") else
                        "this family runs on one machine only")
    layers, ranks = len(inner.layers), group.size()
    if layers < ranks:
        raise UserError("distributed.indivisible", f"{ranks} pipeline stages need at least "
                        f"{ranks} layers; this trunk has {layers}", "use fewer ranks")
    inner.pipeline(group)
    local = {id(m) for layer in inner.pipeline_layers for _, m in layer.named_modules()}
    trunk.recorders = [r for r in trunk.recorders if id(r) in local]
    if group.rank() == 0 and not any(_is_attention(layer) for layer in inner.pipeline_layers):
        raise UserError("distributed.unsupported", "pipeline stage 0 (the last layers) holds "
                        "no attention layer to count committed tokens by", "use --shard tensor")


def _is_attention(layer: Any) -> bool:
    return not getattr(layer, "is_linear", False)


def recurrent_elsewhere(trunk: Trunk, group: mx.distributed.Group) -> bool:
    """Whether another rank holds recurrent layers (rank 0 must roll them back by message)."""
    mine = len(trunk.recorders)
    total = mx.distributed.all_sum(mx.array(mine), group=group, stream=mx.cpu)
    return int(total.item()) > mine


def barrier(group: mx.distributed.Group) -> None:
    """Every rank loaded (mlx-lm's sharded_load does this to avoid timeouts)."""
    mx.eval(mx.distributed.all_sum(mx.array(1.0), group=group, stream=mx.cpu))

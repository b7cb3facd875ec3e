"""MTP decoding over a trunk sharded across machines: rank 0 decides, every rank runs the passes.

Rank 0 runs the ordinary Session (drafts with the head, acceptance, sampling, stop) over a
LeaderTrunk. Before each trunk pass the LeaderTrunk sends every other rank one small int32 array
through `mx.distributed.all_sum` (the others add zeros): the pass's tokens, whether recurrent
layers record it, and rank 0's committed length of the cache. That length tells a follower how
many positions of its previous pass rank 0 kept, so it trims its KV caches and takes the
recorded recurrent state at the same position. Followers run the same passes on their shard and
nothing else: no head, no logits, no sampling, no output. On rank 0 the pass reads its tokens
back from the all_sum, so a lazy token (pipelined plain decoding) stays lazy.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any, Protocol, TypeVar

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import ArraysCache

from mtpkit.decoder.cache.caches import Snapshot, snapshot
from mtpkit.decoder.cache.state import commit_recorded, rewind
from mtpkit.decoder.model.trunk import Trunk
from mtpkit.decoder.sharded import peerwatch
from mtpkit.decoder.sharded.peerwatch import PEER_LOST
from mtpkit.loaders.findings import UserError

MAGIC = 0x4D545031  # "MTP1": a message from another protocol version is refused, not obeyed
# a message's header; count: its tokens, length: rank 0's committed length
FIELDS = ("magic", "op", "value", "count", "length", "real", "recording", "present")
HEADER = len(FIELDS)
PRESENT = FIELDS.index("present")  # the followers present: each adds 1, so rank 0 sees one gone
ROOM = 32  # tokens carried in the message itself; a longer pass (prefill) sends a second array


class Op(IntEnum):
    """What a message asks of the followers (its header's op); value: CACHE's bounded, QUIT's
    exit code."""

    CACHE = 1
    PASS = 2
    QUIT = 3


LOST = ("[ring]", "[jaccl]", "[mpi]", "[nccl]")  # how MLX's backends word a lost peer


class Sharded(Protocol):
    """What leading and following use of a runner (decoder/runner.py's Runner, named by its
    parts: the runner imports this module): its trunk, which rank 0 wraps, and whether it was
    loaded as a shard."""

    trunk: Trunk
    load_options: dict[str, Any]


R = TypeVar("R", bound=Sharded)  # the runner handed in is the runner handed back


class Desync(RuntimeError):
    """A follower was told something its state cannot match (a bug, never a user error)."""


class PeerLost(RuntimeError):
    """A rank is gone: MLX's ring backend may fail a collective with zeros, not an error."""


def committed(cache: list[Any]) -> int:
    """Tokens held by a cache list: the offset of its first attention cache."""
    return next((c.offset for c in cache if hasattr(c, "offset")), 0)


class RemoteRecorder:
    """Stands in rank 0's session for recurrent layers on other pipeline stages: a recorded
    pass goes out as one (its `record` argument is on the wire); the followers commit the kept
    position's state when the next message tells them the committed length."""

    def commit(self, keep: int) -> None:
        """Nothing here: the state lives on the followers (see the class docstring)."""


class LeaderTrunk:
    """Rank 0's trunk: every cache made and every pass run is first sent to the followers.
    remote_recurrent: other stages hold recurrent layers, so rank 0's caches carry a
    stand-in (an untrimmable ArraysCache(0)) and its recorders a RemoteRecorder; the session
    then rolls back as it would over those layers (record, or snapshot and replay). eager: the
    message is delivered before the pass is built; a pipeline stage's receive has no inputs,
    so MLX could schedule it ahead of a lazy message and both ranks would wait forever."""

    def __init__(self, trunk: Trunk, group: mx.distributed.Group, remote_recurrent: bool,
                 eager: bool) -> None:
        self.trunk, self.group, self.remote, self.eager = trunk, group, remote_recurrent, eager
        self.recorders: list[Any] = [*trunk.recorders,
                                     *([RemoteRecorder()] if remote_recurrent else [])]
        self.cache: list[Any] | None = None
        self.span = (0, 0)  # the positions the last pass wrote
        self.unchecked: list[mx.array] = []  # presence counts of messages sent lazily

    def __getattr__(self, name: str) -> Any:
        return getattr(self.trunk, name)

    def _local(self, cache: list[Any]) -> list[Any]:
        return cache[:-1] if self.remote else cache

    def _committed(self) -> int:
        return committed(self._local(self.cache)) if self.cache is not None else 0

    def _check(self, present: mx.array) -> None:
        if int(present.item()) != self.group.size() - 1:
            raise PeerLost("a follower rank is gone: its share of a message is missing")

    def _send(self, header: list[int]) -> None:
        """A message delivered now (after every earlier one was checked)."""
        while self.unchecked:
            self._check(self.unchecked.pop(0))
        message = mx.array(header + [0] * (HEADER - len(header) + ROOM), dtype=mx.int32)
        self._check(mx.distributed.all_sum(message, group=self.group, stream=mx.cpu)[PRESENT])

    def make_cache(self, bounded: bool = False) -> list[Any]:
        """A new cache here and on every follower (the previous one is settled there)."""
        self._send([MAGIC, Op.CACHE, int(bounded), 0, self._committed()])
        cache = self.trunk.make_cache(bounded)
        if self.remote:
            cache.append(ArraysCache(0))
        self.cache, self.span = cache, (0, 0)
        return cache

    def __call__(self, tokens: mx.array, cache: list[Any], logits_for: int | None = None,
                 real: int | None = None, record: bool = False
                 ) -> tuple[mx.array, mx.array | None]:
        if cache is not self.cache:
            raise Desync("a sharded trunk follows one cache at a time: the last one made")
        local = self._local(cache)
        length = committed(local)
        if not self.span[0] <= length <= self.span[1]:
            raise Desync(f"the cache holds {length} tokens but the last pass wrote positions "
                         f"{self.span[0]}..{self.span[1]}: a sharded trunk's cache changes only "
                         "by its own passes and trims (no prefix cache)")
        while len(self.unchecked) > 1:  # the one before last has been evaluated by now
            self._check(self.unchecked.pop(0))
        flat = tokens.reshape(-1).astype(mx.int32)
        n = flat.size
        self.span = (length, length + n)
        header = [MAGIC, Op.PASS, 0, n, length, real or 0, int(record), 0]
        if n <= ROOM:  # lazy: the pass below depends on the all_sum, which keeps the order
            message = mx.concatenate([mx.array(header, dtype=mx.int32), flat,
                                      mx.zeros(ROOM - n, mx.int32)])
            sent = mx.distributed.all_sum(message, group=self.group, stream=mx.cpu)
            present = sent[PRESENT]
            mx.async_eval(present)  # here: the check may come from another thread (serve),
            self.unchecked.append(present)  # which cannot run this thread's stream
            flat = sent[HEADER:HEADER + n]
            if self.eager:
                mx.eval(flat)
        else:
            self._send(header)
            flat = mx.distributed.all_sum(flat, group=self.group, stream=mx.cpu)
            mx.eval(flat)
        hidden, logits = self.trunk(flat[None], local, logits_for, real, record)
        if logits_for == 0:  # the caller may read only the caches, which do not depend on the
            mx.eval(hidden)  # pass's last collectives (the followers wait in them)
        return hidden, logits

    def quit(self, code: int) -> None:
        """Tell the followers to settle the last cache and exit with `code`."""
        peerwatch.disarm()  # they close their connections once they have read it
        self._send([MAGIC, Op.QUIT, code, 0, self._committed()])


@dataclass
class Transcript:
    """What one of a follower's caches held when rank 0 moved on: the tokens, as many as
    rank 0's committed length, and that length as the follower's attention caches count it."""

    tokens: list[int]
    offset: int


@dataclass
class _Pass:
    start: int
    size: int
    saved: Snapshot
    recorded: bool


@dataclass
class Follower:
    """A rank > 0: runs rank 0's passes on its shard until rank 0 quits."""

    trunk: Trunk
    group: mx.distributed.Group
    transcripts: list[Transcript] = field(default_factory=list)
    cache: list[Any] | None = None
    fed: list[int] = field(default_factory=list)
    pending: _Pass | None = None
    code: int | None = None  # rank 0's exit code, once it quit

    def run(self) -> int:
        """Follow until rank 0 quits; its exit code."""
        while True:
            op, value, tokens, length, real, recording = self._receive()
            if op == Op.PASS:
                self._settle(length)
                self._pass(tokens, real, recording)
                continue
            if self.cache is not None:
                self._settle(length)
                self.transcripts.append(Transcript(self.fed[:length], committed(self.cache)))
            if op == Op.QUIT:
                peerwatch.disarm()  # rank 0 closes its connections now
                self.code = value
                return value
            self.cache, self.fed, self.pending = self.trunk.make_cache(bool(value)), [], None

    def _receive(self) -> tuple[int, int, list[int], int, int, bool]:
        """(op, value, tokens, committed length, real, recording) of rank 0's next message."""
        blank = np.zeros(HEADER + ROOM, np.int32)
        blank[PRESENT] = 1
        message = np.array(mx.distributed.all_sum(mx.array(blank), group=self.group,
                                                  stream=mx.cpu))
        magic, op, value, n, length, real, recording, _ = message[:HEADER].tolist()
        if magic == 0:
            raise PeerLost("rank 0 is gone: its message came back empty")
        if magic != MAGIC or op not in tuple(Op):
            raise Desync(f"not a message of this protocol: {message[:HEADER].tolist()}")
        tokens = message[HEADER:HEADER + n] if n <= ROOM else np.array(
            mx.distributed.all_sum(mx.zeros(n, mx.int32), group=self.group, stream=mx.cpu))
        return op, value, tokens.tolist(), length, real, bool(recording)

    def _pass(self, tokens: list[int], real: int, recording: bool) -> None:
        assert self.cache is not None
        saved = snapshot(self.cache, len(tokens))
        hidden, _ = self.trunk(mx.array(tokens)[None], self.cache, logits_for=0,
                               real=real or None, record=recording)
        mx.eval(hidden, [c.state for c in self.cache])
        start = len(self.fed)
        self.fed += tokens
        self.pending = _Pass(start, len(tokens), saved, recording)

    def _settle(self, length: int) -> None:
        """Keep what rank 0 kept of the last pass: its cache holds `length` tokens now."""
        assert self.cache is not None
        done, self.pending = self.pending, None
        if done is not None:
            keep = length - done.start
            if not 0 <= keep <= done.size:
                raise Desync(f"rank 0 holds {length} tokens; this rank's last pass covered "
                             f"{done.start}..{done.start + done.size}")
            if done.recorded and keep > 0:
                commit_recorded(self.cache, self.trunk.recorders, done.size, keep)
            elif rewind(self.cache, done.saved, done.size, keep):
                raise Desync("rank 0 kept part of an unrecorded pass over recurrent layers")
            del self.fed[length:]
        if len(self.fed) != length or committed(self.cache) not in (0, length):
            raise Desync(f"rank 0 holds {length} tokens, this rank {len(self.fed)} "
                         f"(caches: {committed(self.cache)})")


def attach(runner: R, group: mx.distributed.Group, mode: str) -> R:
    """Rank 0's runner drives the followers through a LeaderTrunk."""
    from mtpkit.decoder.sharded.sharding import recurrent_elsewhere

    remote = mode == "pipeline" and recurrent_elsewhere(runner.trunk, group)
    if group.rank() == 0:
        runner.trunk = LeaderTrunk(runner.trunk, group, remote,  # type: ignore[assignment]
                                   eager=mode == "pipeline")
    return runner


def follow(runner: Sharded) -> Follower:
    """Run a follower rank's part until rank 0 quits (its exit code in `.code`)."""
    follower = Follower(runner.trunk, mx.distributed.init())
    with _lost_peers():
        follower.run()
    return follower


def finish(runner: Sharded, code: int = 0) -> None:
    """Rank 0 is done: the followers settle and exit with `code`."""
    if isinstance(runner.trunk, LeaderTrunk):
        runner.trunk.quit(code)


def is_follower(runner: Sharded) -> bool:
    return "shard" in runner.load_options and mx.distributed.init().rank() > 0


def _lost(exc: BaseException) -> bool:
    return isinstance(exc, PeerLost) or isinstance(exc, RuntimeError) and str(exc).startswith(LOST)


@contextmanager
def _lost_peers() -> Iterator[None]:
    """A lost rank: one line and PEER_LOST, not a traceback."""
    try:
        yield
    except RuntimeError as exc:
        if not _lost(exc):
            raise
        sys.stderr.flush()
        peerwatch.report(str(exc))  # armed still: it ends this rank if the exit hangs in MLX
        raise SystemExit(PEER_LOST) from None


_LEADING: list[list[Sharded]] = []  # per command running under leading(): the runners it led


def lead(runner: R) -> R:
    """For a command: on a follower rank, follow rank 0 and exit with rank 0's exit code; on
    rank 0 (or unsharded) return the runner; under leading(), its followers are told to exit
    with the command's code when the command ends."""
    if is_follower(runner):
        raise SystemExit(follow(runner).code)
    if _LEADING:
        _LEADING[-1].append(runner)
    return runner


@contextmanager
def leading() -> Iterator[None]:
    """Around a command (also a decorator) that may lead followers (see lead): a lost rank is
    one line and PEER_LOST; on the way out the followers get the command's exit code."""
    led: list[Sharded] = []
    _LEADING.append(led)
    code = 1
    try:
        with _lost_peers():
            yield
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 1
        raise
    except UserError:
        code = 2
        raise
    finally:
        _LEADING.pop()
        if code != PEER_LOST:
            with _lost_peers():
                for runner in led:
                    finish(runner, code)

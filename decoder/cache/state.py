"""Rolling the trunk's caches back to the last accepted token.

Attention KV caches are trimmed. Recurrent caches (GatedDeltaNet conv and recurrent state in
mlx-lm's ArraysCache) cannot be trimmed. Two exact ways back: "record" replays the recurrence
over the kept positions from what the verify pass recorded (decoder/cache/recording.py: no weight
read); "replay" restores a snapshot taken before the verify pass and re-runs the kept tokens
through the whole trunk. MLX arrays are immutable, so a snapshot is a copy of references, not
of data.
"""

from __future__ import annotations

from typing import Any

from mtpkit.decoder.cache.caches import Snapshot, restore, trimmable
from mtpkit.decoder.cache.recording import StateRecorder


def rewind(cache: list[Any], saved: Snapshot, verified: int, keep: int) -> bool:
    """Undo the last `verified` positions except the first `keep`. Returns True when the caller
    must replay those `keep` tokens (recurrent state restored to before the verify pass)."""
    if keep == verified:
        return False
    if trimmable(cache):
        for c in cache:
            c.trim(verified - keep)
        return False
    for c, state in zip(cache, saved, strict=True):
        if state is None:
            c.trim(verified)
        else:
            restore(c, state)
    return keep > 0


def commit_recorded(cache: list[Any], recorders: list[StateRecorder], verified: int,
                    keep: int) -> None:
    """Keep the first `keep` verified positions: attention trimmed, recurrent layers replayed
    from what the verify pass recorded."""
    for c in cache:
        if c.is_trimmable():
            c.trim(verified - keep)
    for recorder in recorders:
        recorder.commit(keep)

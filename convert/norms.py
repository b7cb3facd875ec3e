"""Re-encode RMSNorm gain vectors one by one (a sidecar can mix zero-centred and shifted)."""

from __future__ import annotations

import mlx.core as mx

from mtpkit.loaders.families import is_shifted_norm
from mtpkit.loaders.mtp import norm_level

ABSOLUTE = 1  # norm_level of gains stored with the +1 applied, as mlx-lm stores trunk norms


def reencode_norms(arrays: dict[str, mx.array], target: int = ABSOLUTE) -> int:
    """Shift each norm vector in place to `target`'s encoding; return how many moved. Only the
    small 1-D gain vectors are evaluated."""
    moved = 0
    for name, arr in arrays.items():
        if arr.ndim != 1 or not is_shifted_norm(name):
            continue
        level = norm_level(arr.astype(mx.float32).mean().item())
        if level is not None and level != target:
            arrays[name] = arr + float(target - level)
            moved += 1
    return moved

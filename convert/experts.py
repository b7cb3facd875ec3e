"""Stack MoE experts into MLX switch layers, from numbered or fused layouts, for weight /
scales / biases alike (the step the real 35B sidecar never got)."""

from __future__ import annotations

from collections import defaultdict

import mlx.core as mx

from mtpkit.loaders.families import expert_layout

PROJ_NAMES = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}


def stack_experts(tensors: dict[str, mx.array], hidden_size: int) -> dict[str, mx.array]:
    """Return `tensors` with every numbered / fused expert group replaced by
    `<moe>.switch_mlp.{gate,up,down}_proj.{param}` stacks (experts on axis 0). Lazy."""
    out: dict[str, mx.array] = {}
    numbered: dict[tuple[str, str, str], dict[int, mx.array]] = defaultdict(dict)
    for name, arr in tensors.items():
        hit = expert_layout(name)
        if hit is None or hit[0] == "stacked":
            out[name] = arr
            continue
        layout, m = hit
        param = m["param"] or "weight"
        proj = PROJ_NAMES.get(m["proj"], m["proj"])
        if layout == "numbered":
            numbered[(m["moe"], proj, param)][int(m["expert"])] = arr
        elif proj == "gate_up_proj":
            # [E, 2I, H] (gate first along -2); some exports store [E, H, 2I].
            if param == "weight" and arr.shape[-2] == hidden_size and arr.shape[-1] != hidden_size:
                arr = arr.swapaxes(-1, -2)
            half = arr.shape[-2] // 2
            out[f"{m['moe']}.switch_mlp.gate_proj.{param}"] = arr[..., :half, :]
            out[f"{m['moe']}.switch_mlp.up_proj.{param}"] = arr[..., half:, :]
        else:
            if param == "weight" and arr.shape[-2] != hidden_size and arr.shape[-1] == hidden_size:
                arr = arr.swapaxes(-1, -2)  # [E, I, H] orientation -> [E, H, I]
            out[f"{m['moe']}.switch_mlp.down_proj.{param}"] = arr
    for (moe, proj, param), experts in numbered.items():
        order = sorted(experts)
        if order != list(range(len(order))):
            raise ValueError(f"{moe}: expert indices {order[:5]}... are not 0..{len(order) - 1}")
        out[f"{moe}.switch_mlp.{proj}.{param}"] = mx.stack([experts[i] for i in order])
    return out


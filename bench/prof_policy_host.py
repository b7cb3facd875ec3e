"""Host time the depth policy takes per plain step of `--depth auto` (diagnostic, issue 50).

A plain stretch asks the policy after every step whether a round would pay now
(decoder/rounds/controller.py: choose, then the step's bookkeeping), and the generation's
report asks the cost table's summary after every batch. On a GPU a plain step is bound by the
host (docs/long-context.md, "Decode"), so this time is paid on every token. Timed here on a
lone request's policy after 200 rounds and stretches at two context bands (a learning curve:
corrections kept per shape and band), microseconds per call, median of 5 runs.

    python bench/prof_policy_host.py [--calls 3000]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

from mtpkit.decoder.options import Source
from mtpkit.decoder.tuning.curve import CostCurve
from mtpkit.decoder.tuning.policy import DepthPolicy


def per_call(f: Callable[[], object], calls: int) -> float:
    runs = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls):
            f()
        runs.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(runs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=3000)
    args = ap.parse_args()
    curve = CostCurve([0.009 + 0.0006 * t for t in range(16)], plain=0.008, draft=0.0004,
                      context=512, estimate=True)
    policy = DepthPolicy(curve, max_depth=6)
    for i in range(200):
        policy.context = 1024 if i < 100 else 4096
        depth = 1 + i % 4
        policy.record(depth, i % (depth + 1), Source.HEAD)
        policy.observe_round(0.01 + 0.001 * depth, depth, Source.HEAD, depth,
                             shape=("round", depth), width=depth + 1)
        policy.observe_plain(0.008 * 33, 33)
        policy.costs.tick(1)

    def step() -> None:  # what the controller asks around one plain step of a stretch
        policy.choose(0)
        policy.plain()
        policy.costs.tick(1)
        policy.cost(0)

    print(f"choose and bookkeeping per plain step: {per_call(step, args.calls):.1f} us")
    print(f"the report's summary ({len(policy.costs.ratios)} shapes timed): "
          f"{per_call(policy.costs.summary, args.calls):.1f} us")


if __name__ == "__main__":
    main()

"""bench_context.py with every pipelined stretch of our arms traced: what it ran (`kind`: plain
steps or rounds at depth K), what building its first pass took (`started`, ms: the restart),
each read's own seconds and the stretch's mean so far (ms), and after each auto run the cost
table's view of each pass shape at the run's context (prior, correction, decayed timings, the
last times paid) and the scheduler's choices of depth where they changed (a batch's, or a lone
request's on a GPU), with what each weighed. Written to probe.json in --out (else $OUT, else
/tmp) after every run; arguments are bench_context.py's. How auto's choices were traced to their
cause on the H200 (BENCHMARKS.md, context sweep, 2026-11-30 late):

    python bench/prof_stretch.py --oracle rows --contexts 1024,16384 \\
        --arms mlx_lm,plain,d3,auto --tokens 96 --runs 3 --passes 3 --warmup first --out /tmp
"""
import argparse
import importlib.util
import json
import os
import sys
import time
from pathlib import Path

from mtpkit.decoder.rounds import session as S

logs: list[dict] = []
init0, started0, read0 = S.StretchClock.__init__, S.StretchClock.started, S.StretchClock.read


kind: list[str] = ["plain"]  # what the next clock times: "plain", or "dK" pipelined rounds


def init(self) -> None:
    init0(self)
    self._log = {"kind": kind[0], "t0": time.perf_counter(), "started": None, "reads": [],
                 "fresh": 0}
    logs.append(self._log)


def tagged(real, name):
    """Batch.spec_rounds / plain_steps, telling the clocks they make what they time."""
    def run(self, *args, **kwargs):
        kind[0] = f"d{args[0]}" if name == "spec_rounds" else "plain"
        yield from real(self, *args, **kwargs)
    return run


def started(self) -> None:
    self._log["started"] = round((time.perf_counter() - self._log["t0"]) * 1e3, 2)
    started0(self)


def read(self) -> float:
    raw = time.perf_counter() - self.begin
    self._log["fresh"] += len(self.fresh)
    v = read0(self)
    self._log["reads"].append((round(raw * 1e3, 2), round(v * 1e3, 2)))
    return v


decisions: list[dict] = []  # the scheduler's choices of depth where they changed


def deciding(real):
    """Scheduler._depth, its choice logged with what it weighed where it changed (or where no
    stretch ran): the running shape, the keys, the first auto row's head acceptance, each
    depth's pass prior / correction / decayed timings, the table's restart."""
    def depth(self, auto, running=None):
        chosen = real(self, auto, running)
        if self.paid is None or decisions and decisions[-1]["chosen"] == chosen and running:
            return chosen
        t, keys, rows = self.paid, self._keys(), len(self.active)
        shapes = {d: (rows, d + 1, d == 0 or self._pipelines()) for d in range(9)}
        decisions.append({
            "chosen": chosen, "running": running, "keys": keys,
            "head": [round(a, 3) for a in auto[0].policy.acceptance()],
            "restart_ms": round(t.restart(rows) * 1e3, 2),
            "shapes": {d: (round(t.prior(sh, keys) * 1e3, 2), round(t.correction(sh, keys), 3),
                           round(t.timings(sh), 2)) for d, sh in shapes.items()}})
        return chosen
    return depth


def main() -> None:
    S.StretchClock.__init__, S.StretchClock.started, S.StretchClock.read = init, started, read
    from mtpkit.decoder.rounds.batch import Batch
    from mtpkit.decoder.rounds.scheduler import Scheduler
    for name in ("spec_rounds", "plain_steps"):
        setattr(Batch, name, tagged(getattr(Batch, name), name))
    Scheduler._depth = deciding(Scheduler._depth)

    path = Path(__file__).resolve().parent / "bench_context.py"
    spec = importlib.util.spec_from_file_location("bench_context", path)
    bc = importlib.util.module_from_spec(spec)
    sys.modules["bench_context"] = bc
    spec.loader.exec_module(bc)
    given = argparse.ArgumentParser(add_help=False)  # bench_context's --out, as it reads it
    given.add_argument("--out")
    out = Path(given.parse_known_args()[0].out or os.environ.get("OUT", "/tmp")) / "probe.json"
    probe: list[dict] = []
    run0 = bc.run_ours

    def run_ours(runner, arm, ids, tokens, *a, **k):
        start, chose = len(logs), len(decisions)
        row = run0(runner, arm, ids, tokens, *a, **k)
        entry = {"arm": arm.name, "context": len(ids), "tps": row["decode_tps"],
                 "stretches": [{k2: s[k2] for k2 in ("kind", "started", "reads", "fresh")}
                               for s in logs[start:]]}
        if arm.mode == "auto":
            t = runner.table()
            ctx = len(ids) + tokens
            shapes = sorted({*t.ratios, *t.seeded, *[(1, w, p) for w in (1, 2, 3, 4, 5)
                                                       for p in (True, False)]})
            entry["table"] = {f"{r}x{w}{' piped' if p else ''}": {
                "prior_ms": round(t.prior((r, w, p), ctx) * 1e3, 2),
                "corr": round(t.correction((r, w, p), ctx), 3),
                "timings": round(t.timings((r, w, p)), 2),
                "times_ms": [round(x * 1e3, 2) for x in t.times.get((r, w, p), [])][-12:]}
                for r, w, p in shapes}
            entry["depths"] = row.get("depths")
            entry["decisions"] = decisions[chose:]
        probe.append(entry)
        out.write_text(json.dumps(probe, indent=1))
        return row

    bc.run_ours = run_ours
    sys.argv = [str(path)] + sys.argv[1:]
    bc.main()


if __name__ == "__main__":
    main()

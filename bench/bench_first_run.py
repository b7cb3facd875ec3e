"""A newcomer's first hour: `bash scripts/demo.sh` from a fresh clone, on a terminal.

Clones the committed tree into a temporary folder and runs the demo there under a pseudo-terminal
(so progress bars draw as they do for a user), with an empty mtpkit cache (the cost curve is
measured as on a new machine) and, with --no-pip-cache, pip's cache off (every wheel downloaded).
Every line or bar redraw is stamped; the report is the wall time, the longest silences (what was
on screen before each, what came after) and the demo's own result line.

    .venv/bin/python bench/bench_first_run.py [--no-pip-cache] [--gaps 8]
"""

from __future__ import annotations

import argparse
import os
import pty
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import save  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
ANSI = re.compile(rb"\x1b\[[0-9;?]*[A-Za-z]")


def stamped(command: list[str], cwd: Path, env: dict[str, str]) -> tuple[list[tuple[float, str]],
                                                                           int]:
    """(seconds since start, line) for every line or redraw the command writes to its terminal,
    and its exit status."""
    leader, follower = pty.openpty()
    proc = subprocess.Popen(command, cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                            stdout=follower, stderr=follower)
    os.close(follower)
    start, lines, rest = time.perf_counter(), [], b""
    while True:
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # the terminal closed with the last process on it
            break
        if not chunk:
            break
        now = time.perf_counter() - start
        *done, rest = re.split(rb"[\r\n]", rest + chunk)
        lines += [(now, text) for raw in done
                  if (text := ANSI.sub(b"", raw).decode(errors="replace").strip())]
    os.close(leader)
    return lines, proc.wait()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--no-pip-cache", action="store_true", help="download every wheel")
    ap.add_argument("--gaps", type=int, default=8, help="how many of the longest silences")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        clone = Path(tmp) / "mtpkit"
        subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=clone, text=True,
                                capture_output=True, check=True).stdout.strip()
        env = {**os.environ, "XDG_CACHE_HOME": str(Path(tmp) / "cache")}
        env.pop("MTPKIT_CACHE", None)
        if args.no_pip_cache:
            env["PIP_NO_CACHE_DIR"] = "1"
        lines, code = stamped(["bash", "scripts/demo.sh"], clone, env)
    total = lines[-1][0] if lines else 0.0
    pairs = zip(lines, lines[1:], strict=False)
    gaps = sorted(((b[0] - a[0], a[1][:120], b[1][:120]) for a, b in pairs),
                  reverse=True)[:args.gaps]
    result = next((text for _, text in reversed(lines) if text.startswith("[plain ")), None)
    print(f"{commit}: exit {code}, {total:.0f} s, {len(lines)} lines; {result}")
    for gap, before, after in gaps:
        print(f"  {gap:5.1f} s silent after: {before}\n          then: {after}")
    doc = {"commit": commit, "exit": code, "seconds": total, "lines": len(lines),
           "result": result, "no_pip_cache": args.no_pip_cache,
           "gaps": [{"seconds": g, "before": b, "after": a} for g, b, a in gaps]}
    print(f"saved {save('first-run', doc)}")


if __name__ == "__main__":
    main()

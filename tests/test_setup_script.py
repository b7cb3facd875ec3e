"""scripts/apt-install.sh, which setup.sh installs Debian packages through: a hung or locked
package manager is said in one line and skipped in seconds (a newcomer's first demo sat silent
for 5 minutes behind `timeout 300 apt-get ... >/dev/null`). apt-get is a stand-in on PATH."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "apt-install.sh"


def _run(tmp_path: Path, body: str, **env: str) -> tuple[int, str, float]:
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "apt-get").write_text("#!/usr/bin/env bash\n" + body)
    (fake / "apt-get").chmod(0o755)
    start = time.perf_counter()
    proc = subprocess.run(["bash", str(SCRIPT), "a test", "libfoo"], capture_output=True,
                          text=True, timeout=60,
                          env={**os.environ, "PATH": f"{fake}:{os.environ['PATH']}", **env})
    return proc.returncode, proc.stderr, time.perf_counter() - start


def test_an_apt_get_that_hangs_silently_is_stopped_and_said(tmp_path: Path) -> None:
    code, err, took = _run(tmp_path, "sleep 30\n", APT_STALL_S="1")
    assert code == 1 and took < 10, (took, err)
    assert "printed nothing for 1 s" in err and "skipped libfoo" in err


def test_a_held_dpkg_lock_names_its_holder(tmp_path: Path) -> None:
    code, err, took = _run(tmp_path, 'echo "E: Could not get lock /var/lib/dpkg/lock-frontend. '
                           'It is held by process 4242 (unattended-upgr)"\nexit 100\n')
    assert code == 1 and took < 10
    assert "holds the dpkg lock (process 4242 (unattended-upgr)" in err
    assert "refreshing" not in err  # a lock is not retried through an update


def test_an_unreachable_mirror_is_said_and_not_retried(tmp_path: Path) -> None:
    code, err, _ = _run(tmp_path, "echo \"Err:1 http://deb.debian.org Could not resolve "
                        "'deb.debian.org'\"\nexit 100\n")
    assert code == 1 and "cannot be reached" in err
    assert "refreshing" not in err  # an update would wait on the same mirror


@pytest.mark.parametrize("percents", [(0, 5, 12, 50, 100)])
def test_progress_streams_and_success_is_said(tmp_path: Path, percents: tuple[int, ...]) -> None:
    lines = "".join(f'echo "pmstatus:libfoo:{p}:Unpacking libfoo"\n' for p in percents)
    code, err, _ = _run(tmp_path, lines)
    assert code == 0 and "installed libfoo" in err
    shown = [line for line in err.splitlines() if line.startswith("  apt: pm")]
    assert [line.split()[2] for line in shown] == ["0%", "12%", "50%", "100%"]  # a line per 10%

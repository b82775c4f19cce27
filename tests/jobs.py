"""Helpers the multi-process tests share: the environment of a job they start, running one to its end, and
killing what is left of one."""
from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), str(REPO), env.get("PYTHONPATH", "")])
    env["OMP_NUM_THREADS"] = "1"
    # Lightning leaves its rendezvous variables in os.environ after an in-process run: start clean
    for k in ("LOCAL_RANK", "NODE_RANK", "GROUP_RANK", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
              "PL_GLOBAL_SEED", "PL_SEED_WORKERS", "LOOC_LAUNCHER_PID"):  # fmt: skip
        env.pop(k, None)
    return env


def _killpg(proc: subprocess.Popen) -> None:
    """Kill whatever is left of the run's session (a test failure must not leave ranks behind)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _run(cmd, tmp: Path) -> subprocess.CompletedProcess:
    proc = subprocess.Popen(cmd, cwd=tmp, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # fmt: skip
    try:
        out, err = proc.communicate(timeout=600)
    finally:
        _killpg(proc)
    assert proc.returncode == 0, out[-3000:] + err[-6000:]
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)

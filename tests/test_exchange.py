"""The row exchange between processes (gloo, loopback): exact rows from many threads, a coordinated stop, and
an owner's failure an error on the others within seconds."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).parent


def _run(mode: str, world: int, out: Path) -> list[dict]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [subprocess.Popen([sys.executable, str(TESTS / "exchange_run.py"), mode, str(out)],
                              env={**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                                   "RANK": str(r), "WORLD_SIZE": str(world), "OMP_NUM_THREADS": "1"},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(world)]  # fmt: skip
    for p in procs:
        stdout, _ = p.communicate(timeout=120)
        assert p.returncode == 0, stdout[-3000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


@pytest.mark.parametrize("world", [2, 4])
def test_rows_are_exact_and_every_process_is_served_until_all_stop(tmp_path, world):
    res = _run("rows", world, tmp_path)
    for r in res:
        assert r["bad"] == 0 and r["asked"] > 0 and r["closed"]
        assert r["counters"]["rows_received"] == r["asked"]  # every row asked, nothing more
    assert sum(r["counters"]["rows_sent"] for r in res) == sum(r["asked"] for r in res)


@pytest.mark.parametrize("mode", ["serve_fails", "abort"])
def test_an_owner_that_fails_or_leaves_is_an_error_on_the_others(tmp_path, mode):
    res = _run(mode, 3, tmp_path)
    for r in res:
        assert r["raised"] is not None, r  # nobody hangs, nobody gets rows
        assert r["seconds"] < 10  # the group times out after 60 s and the leaver lives 12 s more: it was propagated
    assert "row exchange" in res[0]["raised"]


def test_a_script_that_ends_without_closing_the_exchange_exits_cleanly(tmp_path):
    """Left open at the end of a script, the exchange thread was ended inside a gloo collective at interpreter
    exit: "terminate called without an active exception" (status -6) on one process and a connection error on
    the other, nearly every run. It is now closed at exit, waiting for the others to stop too."""
    for _ in range(2):
        res = _run("exit", 2, tmp_path)  # every process exits with status 0 (asserted in _run)
        assert [r["rank"] for r in res] == [0, 1]

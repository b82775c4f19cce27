"""One process of a row exchange, for tests/test_exchange.py: ``exchange_run.py MODE OUT`` under
MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE. Writes ``OUT/rank<R>.json``."""
from __future__ import annotations

import json
import os
import sys
import threading
import time

import torch
import torch.distributed as dist

from lightning_ooc.partitioned.exchange import ExchangeError, RowExchange, exchange_group


def main() -> None:
    mode, out = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    r, w = dist.get_rank(), dist.get_world_size()
    n, f = 5000, 6
    owner = (torch.arange(n) * 7919 % w).to(torch.int32)
    table = torch.randn(n, f, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)

    def serve(ids: torch.Tensor) -> torch.Tensor:
        if not bool((owner[ids] == r).all()):
            raise AssertionError("asked for rows another machine owns")
        if mode == "serve_fails" and r == w - 1:
            raise OSError(5, "Input/output error", "features.bin")
        return table[ids]

    ex = RowExchange(exchange_group(list(range(w)), 60), owner, r, serve, f, torch.bfloat16, name=f"r{r}")
    result: dict = {"rank": r}
    if mode == "rows":
        bad, asked = [], 0

        def worker(k: int) -> None:
            nonlocal asked
            g = torch.Generator().manual_seed(1000 * r + k)
            for _ in range(40):
                ids = torch.randint(0, n, (int(torch.randint(0, 400, (1,), generator=g)),), generator=g).unique()
                ids = ids[owner[ids] != r]
                asked += ids.numel()
                if not torch.equal(ex.fetch(ids), table[ids]):
                    bad.append(k)

        threads = [threading.Thread(target=worker, args=(k,)) for k in range(3)]
        [t.start() for t in threads]
        [t.join() for t in threads]
        time.sleep(0.2 * r)  # the ranks ask to stop at different times: the later ones are still served
        ex.close(60)
        result.update(bad=len(bad), asked=asked, counters=ex.counters(), closed=not ex._thread.is_alive())
    elif mode == "exit":  # a script that ends without closing the exchange
        ex.fetch(torch.nonzero(owner != r).flatten()[:50])
        with open(os.path.join(out, f"rank{r}.json"), "w") as fh:
            json.dump(result, fh)
        time.sleep(0.3 * r)
        return
    elif mode == "abort" and r == w - 1:  # an error here: this process leaves the exchange but lives on
        ex.fetch(torch.nonzero(owner != r).flatten()[:50])
        ex.abort()
        result["raised"] = "aborted"
        result["seconds"] = 0.0
        with open(os.path.join(out, f"rank{r}.json"), "w") as fh:
            json.dump(result, fh)
        time.sleep(12)  # alive, not answering: the others must not wait for it
        os._exit(0)
    else:
        t0 = time.monotonic()
        try:
            for _ in range(10000):
                ex.fetch(torch.nonzero(owner != r).flatten()[:50])
            result["raised"] = None
        except ExchangeError as e:
            result["raised"] = str(e)
        result["seconds"] = time.monotonic() - t0
        ex.abort()
    with open(os.path.join(out, f"rank{r}.json"), "w") as fh:
        json.dump(result, fh)
    os._exit(0)  # the failed group cannot be torn down collectively


if __name__ == "__main__":
    main()

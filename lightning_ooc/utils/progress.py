"""Progress bars and timing lines for long steps."""
from __future__ import annotations

import logging
import sys
import time
from contextlib import contextmanager
from typing import Iterator

from tqdm.auto import tqdm

log = logging.getLogger("lightning_ooc")


def progress_bar(total: int | None, desc: str, unit: str = "it", enabled: bool = True, scale: bool = True) -> tqdm:
    """A tqdm bar on stderr that shows a rate; ``enabled=False`` gives a silent one."""
    return tqdm(
        total=total,
        desc=desc,
        unit=unit,
        unit_scale=scale,
        disable=not enabled,
        file=sys.stderr,
        mininterval=0.5,
        dynamic_ncols=True,
        leave=True,
    )


@contextmanager
def timed(what: str, enabled: bool = True) -> Iterator[dict]:
    """Log how long a block took: ``with timed("build CSC") as t: ...``; ``t["seconds"]`` after."""
    info: dict = {}
    t0 = time.perf_counter()
    try:
        yield info
    finally:
        info["seconds"] = time.perf_counter() - t0
        if enabled:
            log.info("%s: %.2f s", what, info["seconds"])

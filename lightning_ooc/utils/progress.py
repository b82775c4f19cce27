"""Progress bars for long steps."""
from __future__ import annotations

import sys

from tqdm.auto import tqdm


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

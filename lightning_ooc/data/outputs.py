"""The one check every output path goes through, before anything is written.

Each command and API that writes (a dataset directory, a prediction file, ``npy=`` exports, traces,
benchmark results, the pack and work directories the package keeps beside its outputs) calls
:func:`check_output` with the run's inputs. An output is refused, with one line naming it and the fix, when:

* it is one of the run's inputs, holds one, or lies inside an input directory. A dataset's inputs include the
  files it uses in place (``meta.json``'s ``in_place``: a user's ``.npy`` feature file outside the dataset);
  paths are compared after resolving links, and by inode where both exist;
* it lies inside a dataset (or embedding table) directory of ours, an input of this run or not: a dataset holds
  its own files only, and one of them replaced by a prediction would still open;
* a file is there and ``overwrite`` is not given (a directory, link target or FIFO is never replaced by a file).

What may replace a dataset directory with ``overwrite`` is :func:`~lightning_ooc.data.commit.check_replaceable`'s
question, asked by :class:`~lightning_ooc.data.writer.WriteTarget` under the target's lock.

Example::

    >>> import tempfile
    >>> from pathlib import Path
    >>> from lightning_ooc.data.synth import synthesize
    >>> root = synthesize(tempfile.mkdtemp() + "/g", num_nodes=200, avg_degree=4, num_features=4, num_classes=2,
    ...                   progress=False)
    >>> check_output(root / "labels.npy", inputs=[root], overwrite=True, option="path")
    Traceback (most recent call last):
    ...
    lightning_ooc.errors.DatasetWriteError: .../labels.npy: the output lies inside this command's input ...
    >>> check_output(root.parent / "pred.npy", inputs=[root]).name
    'pred.npy'
"""
from __future__ import annotations

import json
import os
import re
import secrets
import stat
from pathlib import Path
from typing import Any, Callable, Iterable

from lightning_ooc.data.commit import _parse_ours
from lightning_ooc.data.format import META_FILE
from lightning_ooc.data.in_place import IN_PLACE
from lightning_ooc.errors import DatasetWriteError
from lightning_ooc.utils.proc import pid_alive

__all__ = ["check_output", "run_inputs", "dataset_holding", "partial_path", "sweep_partials"]


def _in_place_files(root: Path) -> list[Path]:
    """The files a dataset directory uses in place, as its ``meta.json`` records them (none if it has none)."""
    try:
        meta = json.loads((root / META_FILE).read_text())
    except (OSError, ValueError, UnicodeDecodeError):
        return []
    records = meta.get(IN_PLACE) if isinstance(meta, dict) else None
    if not isinstance(records, dict):
        return []
    return [Path(r["path"]) for r in records.values() if isinstance(r, dict) and isinstance(r.get("path"), str)]


def run_inputs(inputs: Iterable[Any]) -> list[Path]:
    """The paths a run reads: those given (None and non-paths skipped) and, for each dataset directory among
    them, the files it uses in place.

    >>> run_inputs([None, "/nonexistent/x.npy"])
    [PosixPath('/nonexistent/x.npy')]
    """
    out: list[Path] = []
    for given in inputs or ():
        if not isinstance(given, (str, os.PathLike)):
            continue
        p = Path(given)
        out.append(p)
        if (p / META_FILE).is_file():
            out.extend(_in_place_files(p))
    return out


def dataset_holding(path: str | os.PathLike) -> Path | None:
    """The dataset or embedding-table directory of ours that ``path`` lies inside (links resolved), if any.

    >>> dataset_holding("/") is None
    True
    """
    p = Path(os.path.abspath(path)).resolve()
    for d in p.parents:
        meta = d / META_FILE
        try:
            if not stat.S_ISREG(os.stat(meta).st_mode):
                continue
        except OSError:
            continue
        if _parse_ours(meta) is None:
            return d
    return None


def _same(a: Path, b: Path) -> bool:
    try:
        return a.resolve() == b.resolve() or os.path.samefile(a, b)
    except OSError:
        return False


def check_output(path: str | os.PathLike, *, inputs: Iterable[Any] = (), overwrite: bool = False,
                 kind: str = "file", option: str = "--out", ours: Callable[[Path], bool] | None = None,
                 overwrite_option: str = "overwrite=True (--overwrite)") -> Path:  # fmt: skip
    """Raise :class:`~lightning_ooc.errors.DatasetWriteError` unless ``path`` may be written; returns it absolute.

    Args:
        path: the output.
        inputs: what the run reads (dataset directories, files; their in-place files are added).
        overwrite: a file already at ``path`` may be replaced (``kind="file"``).
        kind: ``"file"`` (checked here whole); ``"directory"`` (replaced whole, as a dataset ``--out``: whether
            what is there may be replaced is the writer's question, asked under its lock); ``"workdir"`` (a
            directory the package writes named files into and removes only those, as ``pack_dir`` or
            ``profile``: it may hold an input, say the dataset beside the packs).
        option: how the user names this output (``--out``, ``npy=``, ``PredictionWriter(path=...)``), for the fix.
        ours: recognises a file this package wrote at ``path`` (a benchmark's results, say), which is replaced
            without ``overwrite``.
        overwrite_option: how the user says ``overwrite`` here, for the fix.
    """
    t = Path(os.path.abspath(path))
    rt = t.resolve()
    for src in run_inputs(inputs):
        if not os.path.lexists(src):
            continue
        rs = src.resolve()
        same = _same(src, t)
        if same or (kind != "workdir" and rs.is_relative_to(rt)):
            what = "is" if same else "holds"
            raise DatasetWriteError(
                f"{t}: the output {what} this command's input {src}; writing it would replace what is being "
                f"read, so nothing was touched; choose another {option}"
            )
        if src.is_dir() and rt.is_relative_to(rs):
            raise DatasetWriteError(
                f"{t}: the output lies inside this command's input {src}, which would then hold files that are "
                f"not its own, so nothing was touched; choose {option} outside it"
            )
    holder = dataset_holding(t)
    if holder is not None:
        raise DatasetWriteError(
            f"{t}: the output lies inside the dataset {holder}, which holds its own files only, so nothing was "
            f"touched; choose {option} outside it"
        )
    if kind == "file" and os.path.lexists(t):
        mode = os.lstat(t).st_mode
        if not stat.S_ISREG(mode):
            what = ("a symbolic link" if stat.S_ISLNK(mode) else "a directory" if stat.S_ISDIR(mode)
                    else "not a regular file")  # fmt: skip
            raise DatasetWriteError(f"{t}: is {what}; an output file never replaces it, so nothing was touched; "
                                    f"choose another {option}")  # fmt: skip
        if not overwrite and not (ours is not None and ours(t)):
            raise DatasetWriteError(f"{t}: already exists; pass {overwrite_option} to replace it, or choose "
                                    f"another {option}")  # fmt: skip
    return t


def partial_path(path: str | os.PathLike) -> Path:
    """Where an output file is written before it is renamed to ``path``: ``.NAME.partial-PID-TOKEN`` beside it, a
    name no user picks and no other writer shares (a fixed name would truncate a file of that name).

    >>> p = partial_path("/data/pred.npy")
    >>> p.parent.as_posix(), p.name.startswith(".pred.npy.partial-")
    ('/data', True)
    """
    path = Path(path)
    return path.with_name(f".{path.name}.partial-{os.getpid()}-{secrets.token_hex(4)}")


def sweep_partials(path: str | os.PathLike) -> list[Path]:
    """Remove the partial files of ``path`` (:func:`partial_path`) that writers killed before their rename left
    (their pid no longer runs); returns them. Regular files of exactly that form only.

    >>> sweep_partials("/nonexistent/pred.npy")
    []
    """
    path = Path(path)
    pattern = re.compile(rf"^\.{re.escape(path.name)}\.partial-(\d+)-[0-9a-f]{{8}}$")
    removed = []
    try:
        names = os.listdir(path.parent)
    except OSError:
        return removed
    for name in names:
        m = pattern.match(name)
        if m is None or pid_alive(int(m.group(1))):
            continue
        p = path.parent / name
        try:
            if stat.S_ISREG(os.lstat(p).st_mode):
                os.unlink(p)
                removed.append(p)
        except FileNotFoundError:
            pass
    return removed

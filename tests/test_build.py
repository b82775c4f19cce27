"""The native sources compile with and without liburing (the fallback build must not rot)."""
import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = sorted((ROOT / "ext").glob("*/*.c"))


@pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")
@pytest.mark.parametrize("with_liburing", [False, True], ids=["without-liburing", "with-liburing"])
@pytest.mark.parametrize("source", SOURCES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_source_compiles(source, with_liburing):
    if with_liburing and not Path("/usr/include/liburing.h").exists():
        pytest.skip("liburing-dev headers not installed")
    cmd = ["gcc", "-fsyntax-only", "-std=gnu11", "-Wall", "-Werror", f"-I{sysconfig.get_paths()['include']}",
           f"-I{source.parent}"]  # fmt: skip
    if with_liburing:
        cmd.append("-DLOOC_HAVE_LIBURING=1")
    out = subprocess.run(cmd + [str(source)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def test_built_with_liburing_here():
    """On a machine with liburing-dev (this project's set-up installs it) the real path is built in."""
    from lightning_ooc import _io

    if not Path("/usr/include/liburing.h").exists():
        pytest.skip("liburing-dev headers not installed")
    assert _io.build_info()["liburing"] is True

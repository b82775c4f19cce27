import gc
import os
import signal
import subprocess

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile(
    "default", deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
)
settings.register_profile("ci", parent=settings.get_profile("default"), derandomize=True)
settings.load_profile("ci" if os.environ.get("CI") else "default")

# A shell without job control starts a background command (`make test &`) with SIGINT ignored, and the
# processes the tests start inherit that. The tests of Ctrl-C need it delivered: in this process the usual
# KeyboardInterrupt handler, and in the processes started from here (exec resets a handled signal to its
# default), Python's own.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(scope="session")
def demo_dataset(tmp_path_factory):
    """A small synthetic dataset shared by tests that only read it."""
    from lightning_ooc.testing import make_synthetic

    return make_synthetic(tmp_path_factory.mktemp("demo") / "g", num_nodes=3000, avg_degree=8, num_features=16)


@pytest.fixture
def small_disk(tmp_path):
    """A 2 MiB tmpfs mounted for the test (needs root and a kernel that lets this process mount)."""
    where = tmp_path / "small"
    where.mkdir()
    out = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(where)], capture_output=True,
                         text=True)
    if out.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {out.stderr.strip() or out.returncode}")
    try:
        yield where
    finally:
        gc.collect()  # maps of the datasets read there
        subprocess.run(["umount", str(where)], check=True)


@pytest.fixture(scope="module")
def stand_ins(tmp_path_factory):
    """Small stand-ins of the datasets the README's blocks and the configs name, built on first use (one set per
    test module: tests/readme_snippets.py)."""
    from readme_snippets import StandIns  # a test helper module beside this one, for the modules that use it

    return StandIns(tmp_path_factory.mktemp("stand-ins"))

"""Every output goes through one check, and a writer's lock never truncates or removes a file it did not create."""
import fcntl
import json
import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import lightning_ooc
from lightning_ooc import cli
from lightning_ooc.bench.system import WORKDIR_MARK, bench_output, bench_workdir, save_plot, write_results
from lightning_ooc.data.commit import LOCK_MARK, LockFile, TableLock, TargetLock
from lightning_ooc.data.outputs import check_output, dataset_holding, run_inputs
from lightning_ooc.data.prepare import prepare_from_arrays
from lightning_ooc.data.synth import synthesize
from lightning_ooc.errors import DatasetWriteError, InputError

CLI = [sys.executable, "-m", "lightning_ooc"]
SMALL = ["--nodes", "300", "--avg-degree", "3", "--dim", "4", "--classes", "2", "--no-progress"]


def _dead_pid():
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def _synth(path, **kw):
    return synthesize(path, num_nodes=300, avg_degree=3, num_features=4, num_classes=2, progress=False, **kw)


# -- the writer's lock -----------------------------------------------------------------------------------------
def test_a_users_file_at_the_lock_name_is_kept_and_the_write_refused(tmp_path, capsys):
    _synth(tmp_path / "g")
    (tmp_path / ".g.lock").write_text("notes\n")
    capsys.readouterr()
    assert cli.main(["synth", "--out", str(tmp_path / "g"), *SMALL]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("lightning-ooc: error:")]
    assert len(err) == 1 and "is in the way of the writer's lock" in err[0] and ".g.lock" in err[0]
    assert (tmp_path / ".g.lock").read_text() == "notes\n"
    # --overwrite too: the dataset is kept, the file untouched
    before = lightning_ooc.open_dataset(tmp_path / "g").meta["meta_checksum"]
    assert cli.main(["synth", "--out", str(tmp_path / "g"), "--overwrite", *SMALL]) == 2
    assert (tmp_path / ".g.lock").read_text() == "notes\n"
    assert lightning_ooc.open_dataset(tmp_path / "g").meta["meta_checksum"] == before


@pytest.mark.parametrize("what", ["link", "dir", "empty"])
def test_anything_but_a_marked_lock_is_in_the_way(tmp_path, what):
    p = tmp_path / ".g.lock"
    if what == "link":
        (tmp_path / "elsewhere").write_text("keep")
        p.symlink_to(tmp_path / "elsewhere")
    elif what == "dir":
        p.mkdir()
    else:
        p.write_bytes(b"")
    with pytest.raises(DatasetWriteError, match="in the way of the writer's lock"):
        TargetLock(tmp_path / "g").acquire()
    assert os.path.lexists(p)
    if what == "link":
        assert (tmp_path / "elsewhere").read_text() == "keep"


def test_a_lock_left_by_a_killed_writer_is_reused_and_removed(tmp_path):
    code = textwrap.dedent(f"""
        import os, signal
        from lightning_ooc.data.commit import TargetLock
        TargetLock({str(tmp_path / "g")!r}).acquire()
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    assert subprocess.run([sys.executable, "-c", code]).returncode == -signal.SIGKILL
    left = (tmp_path / ".g.lock").read_bytes()
    assert left.startswith(LOCK_MARK)
    _synth(tmp_path / "g")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["g"]  # the lock and its private name both gone


def test_a_held_lock_names_its_holder_and_is_not_touched(tmp_path):
    held = TargetLock(tmp_path / "g").acquire()
    text = (tmp_path / ".g.lock").read_bytes()
    assert text == LOCK_MARK + f"pid {os.getpid()}\n".encode()
    code = textwrap.dedent(f"""
        from lightning_ooc.data.commit import TargetLock
        TargetLock({str(tmp_path / "g")!r}).acquire()
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode != 0 and f"another writer (pid {os.getpid()})" in r.stderr
    assert (tmp_path / ".g.lock").read_bytes() == text
    held.release()
    assert not (tmp_path / ".g.lock").exists()


def test_release_never_removes_a_file_put_at_the_path_meanwhile(tmp_path):
    held = TargetLock(tmp_path / "g").acquire()
    os.unlink(tmp_path / ".g.lock")
    (tmp_path / ".g.lock").write_text("mine")
    held.release()
    assert (tmp_path / ".g.lock").read_text() == "mine"


def test_the_lock_file_appears_locked_and_marked(tmp_path):
    """Whoever sees the lock file finds it whole: marked, and locked by its creator."""
    held = LockFile(tmp_path / "x.lock").acquire(lambda pid: InputError(pid))
    fd = os.open(tmp_path / "x.lock", os.O_RDONLY)
    try:
        with pytest.raises(BlockingIOError):
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        os.close(fd)
    assert (tmp_path / "x.lock").read_bytes().startswith(LOCK_MARK)
    held.release()


def test_a_tables_lock_stays_and_refuses_a_foreign_file(tmp_path):
    t = TableLock(tmp_path).acquire(lambda pid: InputError(pid))
    t.release()
    assert (tmp_path / "state.lock").read_bytes().startswith(LOCK_MARK)  # kept: it is the table's own file
    TableLock(tmp_path).acquire(lambda pid: InputError(pid)).release()  # and taken again
    (tmp_path / "state.lock").write_text("my notes\n")
    with pytest.raises(DatasetWriteError, match="in the way"):
        TableLock(tmp_path).acquire(lambda pid: InputError(pid))
    assert (tmp_path / "state.lock").read_text() == "my notes\n"


@pytest.mark.parametrize("lock", [TableLock, lambda d: TargetLock(d / "g")])
def test_a_lock_an_earlier_release_wrote_is_still_ours(tmp_path, lock):
    """Such a lock file holds its holder's pid alone; it is taken (and marked), and a held one names its pid."""
    lk = lock(tmp_path)
    path = lk.path
    path.write_text(f"{_dead_pid()}\n")
    held = lk.acquire(lambda pid: InputError(pid)) if isinstance(lk, TableLock) else lk.acquire()
    assert path.read_bytes() == LOCK_MARK + f"pid {os.getpid()}\n".encode()
    held.release()
    path.write_text(f"{os.getpid()}\n")
    fd = os.open(path, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        with pytest.raises((InputError, DatasetWriteError), match=str(os.getpid())):
            lk = lock(tmp_path)
            lk.acquire(lambda pid: InputError(f"held by pid {pid}")) if isinstance(lk, TableLock) else lk.acquire()
    finally:
        os.close(fd)


def test_without_hard_links_the_lock_is_made_at_its_name(tmp_path, monkeypatch):
    """A filesystem that refuses link(2) (vfat, some FUSE mounts): the lock is created exclusively in place."""
    import errno

    def no_link(src, dst):
        raise OSError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(os, "link", no_link)
    held = TargetLock(tmp_path / "g").acquire()
    assert (tmp_path / ".g.lock").read_bytes().startswith(LOCK_MARK)
    code = f"from lightning_ooc.data.commit import TargetLock; TargetLock({str(tmp_path / 'g')!r}).acquire()"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode != 0 and f"another writer (pid {os.getpid()})" in r.stderr
    held.release()
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_private_names_of_killed_holders_are_removed_by_the_next_one(tmp_path):
    dead = _dead_pid()
    left = [tmp_path / f".g.lock.{dead}-0123abcd", tmp_path / f".g.lock.{dead}-89abcdef"]
    left[0].write_bytes(b"")
    left[1].write_bytes(LOCK_MARK + f"pid {dead}\n".encode())
    mine = tmp_path / f".g.lock.{dead}-deadbeef"
    mine.write_text("a user's file of that form")  # not a lock's content: kept
    TargetLock(tmp_path / "g").acquire().release()
    assert not any(p.exists() for p in left) and mine.exists()


# -- the output check ----------------------------------------------------------------------------------------
def test_no_output_file_inside_a_dataset_even_one_not_read(tmp_path):
    root = _synth(tmp_path / "g")
    for name in ("labels.npy", "meta.json", "pred.npy"):
        with pytest.raises(DatasetWriteError, match=f"inside the dataset {root}"):
            check_output(root / name, overwrite=True, option="path")
    assert dataset_holding(root / "sub" / "x.npy") == root
    assert dataset_holding(tmp_path / "pred.npy") is None


def test_an_input_and_its_in_place_file_are_never_outputs(tmp_path):
    x = np.random.default_rng(0).standard_normal((50, 4)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    link = tmp_path / "x-link.npy"
    link.symlink_to(tmp_path / "x.npy")
    root = tmp_path / "d"
    prepare_from_arrays(root, np.array([[0, 1], [1, 2]]), tmp_path / "x.npy", np.arange(50) % 2, features="in-place",
                        progress=False)
    assert tmp_path / "x.npy" in run_inputs([root])
    for p in (tmp_path / "x.npy", link):
        with pytest.raises(DatasetWriteError, match="is this command's input .*x.npy"):
            check_output(p, inputs=[root], overwrite=True, option="npy=")
    assert np.array_equal(np.load(tmp_path / "x.npy"), x)


def test_an_existing_file_needs_overwrite_and_never_a_directory_or_link(tmp_path):
    (tmp_path / "p.npy").write_bytes(b"mine")
    with pytest.raises(DatasetWriteError, match="already exists; pass overwrite=True"):
        check_output(tmp_path / "p.npy")
    assert check_output(tmp_path / "p.npy", overwrite=True) == tmp_path / "p.npy"
    (tmp_path / "d").mkdir()
    os.mkfifo(tmp_path / "f")
    (tmp_path / "l").symlink_to(tmp_path / "p.npy")
    for name, what in (("d", "a directory"), ("f", "not a regular file"), ("l", "a symbolic link")):
        with pytest.raises(DatasetWriteError, match=what):
            check_output(tmp_path / name, overwrite=True)


def test_a_work_directory_may_hold_the_dataset_a_replaced_directory_may_not(tmp_path):
    root = _synth(tmp_path / "g")
    assert check_output(tmp_path, inputs=[root], kind="workdir", option="pack_dir") == tmp_path
    with pytest.raises(DatasetWriteError, match="holds this command's input"):
        check_output(tmp_path, inputs=[root], kind="directory")
    with pytest.raises(DatasetWriteError, match="is this command's input"):
        check_output(root, inputs=[root], kind="workdir", option="pack_dir")


def test_a_dataset_is_not_written_inside_another_one(tmp_path):
    root = _synth(tmp_path / "g")
    with pytest.raises(DatasetWriteError, match="inside the dataset"):
        _synth(root / "sub")
    files = lightning_ooc.open_dataset(root).meta["files"]
    assert sorted(os.listdir(root)) == sorted([f["name"] for f in files.values()] + ["meta.json"])


def test_the_timeline_directory_is_checked(tmp_path):
    root = _synth(tmp_path / "g")
    with pytest.raises(DatasetWriteError, match="profile"):
        lightning_ooc.OutOfCoreNodeData(root=str(root), batch_size=8, num_neighbors=[2],
                                        pipeline={"profile": str(root)})  # fmt: skip


# -- benchmarks' outputs -------------------------------------------------------------------------------------
def test_bench_results_replace_their_own_files_only(tmp_path):
    p = write_results({"kind": "x"}, tmp_path / "r.json", "x")
    assert bench_output(p)
    write_results({"kind": "y"}, p, "y")  # its own: replaced
    assert json.loads(p.read_text())["kind"] == "y"
    (tmp_path / "big.json").write_text(json.dumps({"date": "x", "command": "y", "rows": ["z" * 100] * 2000}))
    write_results({"kind": "x"}, tmp_path / "big.json", "x")  # a large results file of ours (200 KB)
    (tmp_path / "notes.json").write_text('{"mine": 1, "date": "d", "command": "c"}')
    with pytest.raises(DatasetWriteError, match="already exists"):
        write_results({"kind": "x"}, tmp_path / "notes.json", "x")
    assert json.loads((tmp_path / "notes.json").read_text())["mine"] == 1
    (tmp_path / ".r.json.partial").write_text("a user's file")
    write_results({"kind": "x"}, tmp_path / "r.json", "x")
    assert (tmp_path / ".r.json.partial").read_text() == "a user's file"
    root = _synth(tmp_path / "g")
    with pytest.raises(DatasetWriteError, match="inside the dataset"):
        write_results({"kind": "x"}, root / "r.json", "x")


def test_bench_plots_are_marked_and_replace_only_plots_of_ours(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = plt.figure()
    p = save_plot(fig, tmp_path / "a.png")
    assert bench_output(p)
    save_plot(fig, p)
    fig.savefig(tmp_path / "b.png")  # a plot of the user's own
    with pytest.raises(DatasetWriteError, match="already exists"):
        save_plot(fig, tmp_path / "b.png")
    plt.close(fig)


def test_a_bench_work_directory_is_new_empty_or_marked(tmp_path):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "layerwise-out").mkdir()
    (tmp_path / "mine" / "layerwise-out" / "keep.txt").write_text("keep")
    with pytest.raises(DatasetWriteError, match="holds files no benchmark wrote"):
        bench_workdir(tmp_path / "mine")
    assert cli.main(["bench", "infer", str(_synth(tmp_path / "g")), "--workdir", str(tmp_path / "mine"),
                     "--variants", "layerwise"]) == 2  # fmt: skip
    assert (tmp_path / "mine" / "layerwise-out" / "keep.txt").read_text() == "keep"
    (tmp_path / "empty").mkdir()
    assert (bench_workdir(tmp_path / "empty") / WORKDIR_MARK).is_file()

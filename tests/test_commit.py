"""A writer loses nothing: what --overwrite may replace, one writer per target, and commits that are
killed or interrupted halfway (issue: writers, points 1-3)."""
import errno
import os
import signal
import subprocess
import sys
import textwrap

import pytest

import lightning_ooc
from lightning_ooc import cli
from lightning_ooc.data import commit, writer
from lightning_ooc.data.synth import synthesize
from lightning_ooc.data.verify import verify
from lightning_ooc.data.writer import DatasetWriter
from lightning_ooc.testing import dataset_files_bytes

CLI = [sys.executable, "-m", "lightning_ooc"]
SMALL = ["--nodes", "300", "--avg-degree", "3", "--dim", "4", "--classes", "2", "--no-progress"]


def _synth(path, seed=0, **kw):
    return synthesize(path, num_nodes=300, avg_degree=3, num_features=4, num_classes=2, seed=seed,
                      progress=False, **kw)  # fmt: skip


def _seed(path):
    return lightning_ooc.open_dataset(path).meta["source"]["seed"]


def _dead_pid():
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def _siblings(parent, name="g"):
    """Everything beside the target that a writer made: partials, backups, locks."""
    return sorted(p.name for p in parent.iterdir() if p.name.startswith(f".{name}."))


# -- 1. --overwrite replaces only a dataset of ours or an empty directory ------------------------------------------
def test_overwrite_refuses_a_directory_of_user_files(tmp_path):
    d = tmp_path / "g"
    d.mkdir()
    (d / "notes.txt").write_text("mine")
    _synth(d / "other")  # another dataset inside
    with pytest.raises(lightning_ooc.DatasetWriteError, match="not a lightning_ooc dataset .*nothing was touched"):
        _synth(d, overwrite=True)
    assert (d / "notes.txt").read_text() == "mine" and lightning_ooc.open_dataset(d / "other").num_nodes == 300
    assert _siblings(tmp_path) == []


def test_overwrite_refuses_a_dataset_holding_foreign_files(tmp_path):
    _synth(tmp_path / "g")
    (tmp_path / "g" / "results.csv").write_text("acc\n0.9\n")
    (tmp_path / "g" / "runs").mkdir()
    with pytest.raises(lightning_ooc.DatasetWriteError, match=r"holds results.csv, runs/, which a lightning_ooc"):
        _synth(tmp_path / "g", seed=1, overwrite=True)
    assert (tmp_path / "g" / "results.csv").exists() and _seed(tmp_path / "g") == 0


def test_overwrite_refuses_a_file_and_a_link(tmp_path):
    (tmp_path / "g").write_text("a file")
    with pytest.raises(lightning_ooc.DatasetWriteError, match="is a file, not a dataset directory"):
        _synth(tmp_path / "g", overwrite=True)
    assert (tmp_path / "g").read_text() == "a file"
    _synth(tmp_path / "real")
    (tmp_path / "h").symlink_to(tmp_path / "real")
    with pytest.raises(lightning_ooc.DatasetWriteError, match="is a symbolic link"):
        _synth(tmp_path / "h", overwrite=True)
    assert _seed(tmp_path / "real") == 0


def test_overwrite_replaces_an_empty_directory_and_a_dataset(tmp_path):
    (tmp_path / "g").mkdir()
    _synth(tmp_path / "g", overwrite=True)
    assert _seed(tmp_path / "g") == 0
    _synth(tmp_path / "g", seed=3, overwrite=True)
    assert _seed(tmp_path / "g") == 3 and verify(tmp_path / "g", progress=False).ok
    assert _siblings(tmp_path) == []  # no lock, partial or backup left


@pytest.mark.parametrize("meta", [
    '{"tool": "other"}',                                             # a user's own file of that name
    'not json at all',
    '{"format": "lightning_ooc.graph", "version": 99}',              # a version nobody wrote
    '{"format": "lightning_ooc.graph", "version": 2, "num_nodes": 3}',  # ours in name, but no checksum
])
def test_overwrite_refuses_a_directory_whose_meta_json_is_not_ours(tmp_path, meta):
    d = tmp_path / "g"
    d.mkdir()
    (d / "meta.json").write_text(meta)
    with pytest.raises(lightning_ooc.DatasetWriteError, match="not a lightning_ooc dataset or embedding table.*"
                                                              "nothing was touched"):
        _synth(d, overwrite=True)
    assert (d / "meta.json").read_text() == meta and _siblings(tmp_path) == []


def test_overwrite_refuses_an_edited_dataset_but_replaces_a_version_1_one(tmp_path):
    import json

    _synth(tmp_path / "g")
    meta = json.loads((tmp_path / "g" / "meta.json").read_text())
    meta["num_classes"] = 3  # edited by hand: the checksum no longer matches
    (tmp_path / "g" / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(lightning_ooc.DatasetWriteError, match="does not match its own checksum"):
        _synth(tmp_path / "g", seed=1, overwrite=True)
    meta["version"] = 1  # a dataset from before checksums: still one of ours
    del meta["meta_checksum"]
    (tmp_path / "g" / "meta.json").write_text(json.dumps(meta))
    _synth(tmp_path / "g", seed=1, overwrite=True)
    assert _seed(tmp_path / "g") == 1


def test_an_output_is_never_its_own_input(tmp_path):
    from lightning_ooc.data.prepare import prepare_from_dataset
    from lightning_ooc.embed.table import init_embeddings

    g = _synth(tmp_path / "g")
    before = dataset_files_bytes(g)
    for out in (g, tmp_path / "." / "g", g / "sub"):  # itself (two spellings), inside it
        with pytest.raises(lightning_ooc.DatasetWriteError, match="input"):
            init_embeddings(out, dataset=g, dim=4, overwrite=True, progress=False)
        with pytest.raises((lightning_ooc.DatasetWriteError, lightning_ooc.InputError), match="input|another"):
            prepare_from_dataset(out, g, overwrite=True, progress=False)
    (tmp_path / "link").symlink_to(g)
    with pytest.raises(lightning_ooc.DatasetWriteError, match="input"):  # through a link to it
        init_embeddings(tmp_path / "link", dataset=g, dim=4, overwrite=True, progress=False)
    # an output holding the input: replacing it would delete the input
    outer = tmp_path / "outer"
    inner = _synth(outer / "inner")
    with pytest.raises(lightning_ooc.DatasetWriteError, match="holds this command's input"):
        init_embeddings(outer, dataset=inner, dim=4, overwrite=True, progress=False)
    assert dataset_files_bytes(g) == before and lightning_ooc.open_dataset(inner).num_nodes == 300
    assert not (g / "sub").exists() and _siblings(tmp_path) == []
    r = subprocess.run(CLI + ["init-embeddings", "g", "--out", "g", "--overwrite", "--dim", "4"], cwd=tmp_path,
                       capture_output=True, text=True)  # fmt: skip
    assert r.returncode == 2 and "Traceback" not in r.stderr and "input" in r.stderr, r.stderr
    assert dataset_files_bytes(g) == before


def test_partition_output_is_never_its_input(tmp_path):
    from lightning_ooc.partitioned.partition import partition_dataset

    g = _synth(tmp_path / "g")
    with pytest.raises(lightning_ooc.DatasetWriteError, match="input"):
        partition_dataset(g, 2, g, method="range", overwrite=True, progress=False)
    assert lightning_ooc.open_dataset(g).num_nodes == 300


def test_cli_overwrite_of_a_user_directory_is_one_line(tmp_path):
    (tmp_path / "g").mkdir()
    (tmp_path / "g" / "thesis.tex").write_text("x")
    r = subprocess.run(CLI + ["synth", "--out", "g", "--overwrite", *SMALL], cwd=tmp_path, capture_output=True,
                       text=True)  # fmt: skip
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert "not a lightning_ooc dataset" in r.stderr and (tmp_path / "g" / "thesis.tex").exists()


# -- 2. one writer per target; the target is checked again at commit ---------------------------------------------
@pytest.mark.parametrize("overwrite", [False, True])
def test_a_second_writer_is_refused_while_the_first_runs(tmp_path, overwrite):
    if overwrite:
        _synth(tmp_path / "g", seed=9)
    first = DatasetWriter(tmp_path / "g", num_nodes=3, num_features=2, num_classes=2, overwrite=overwrite)
    try:
        with pytest.raises(lightning_ooc.DatasetWriteError, match=rf"another writer \(pid {os.getpid()}\)"):
            _synth(tmp_path / "g", seed=1, overwrite=True)
    finally:
        first.abort()
    _synth(tmp_path / "g", seed=2, overwrite=True)  # the lock went with the first writer
    assert _seed(tmp_path / "g") == 2 and _siblings(tmp_path) == []


def _fill(w, n=3):
    import numpy as np

    w.write_edges(writer.ArrayEdgeSource(np.array([[0, 1, 2], [1, 2, 0]])))
    w.write_features([np.ones((n, 2), dtype=np.float32)])
    w.write_labels([np.array([0, 1, 0])])
    for s, ids in (("train", [0, 1]), ("val", [2]), ("test", [])):
        w.write_split(s, np.array(ids, dtype=np.int64))


def test_a_target_that_appears_during_the_write_is_kept(tmp_path):
    with pytest.raises(lightning_ooc.DatasetWriteError, match="appeared while this dataset was being written"):
        with DatasetWriter(tmp_path / "g", num_nodes=3, num_features=2, num_classes=2) as w:
            _fill(w)
            _synth(tmp_path / "elsewhere")
            os.rename(tmp_path / "elsewhere", tmp_path / "g")  # made by something that takes no lock
            w.commit()
    assert _seed(tmp_path / "g") == 0 and _siblings(tmp_path) == []


def test_an_overwrite_target_that_turns_foreign_during_the_write_is_kept(tmp_path):
    _synth(tmp_path / "g")
    with pytest.raises(lightning_ooc.DatasetWriteError, match="holds mine.txt"):
        with DatasetWriter(tmp_path / "g", num_nodes=3, num_features=2, num_classes=2, overwrite=True) as w:
            _fill(w)
            (tmp_path / "g" / "mine.txt").write_text("x")
            w.commit()
    assert (tmp_path / "g" / "mine.txt").exists() and _seed(tmp_path / "g") == 0


def test_concurrent_overwrite_writers_give_one_line_and_keep_a_dataset(tmp_path):
    assert subprocess.run(CLI + ["synth", "--out", "g", *SMALL], cwd=tmp_path).returncode == 0
    # The first writer holds the target until told to go on, so the second surely runs in between.
    code = textwrap.dedent("""
        import sys
        from lightning_ooc.data.synth import synthesize
        from lightning_ooc.data import writer
        real_init = writer.DatasetWriter.__init__
        def init(self, *a, **k):
            real_init(self, *a, **k)
            print("writing", flush=True)
            sys.stdin.readline()
        writer.DatasetWriter.__init__ = init
        synthesize("g", num_nodes=300, avg_degree=3, num_features=4, num_classes=2, seed=1, overwrite=True,
                   progress=False)
    """)
    first = subprocess.Popen([sys.executable, "-c", code], cwd=tmp_path, stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert first.stdout.readline() == "writing\n"
        second = subprocess.run(CLI + ["synth", "--out", "g", "--overwrite", "--seed", "2", *SMALL], cwd=tmp_path,
                                capture_output=True, text=True)  # fmt: skip
        first.stdin.write("go\n")
        first.stdin.close()
        assert first.wait(120) == 0, first.stderr.read()
    finally:
        first.kill()
    assert second.returncode == 2 and "Traceback" not in second.stderr, second.stderr
    assert f"another writer (pid {first.pid}) is writing it" in second.stderr
    assert _seed(tmp_path / "g") == 1 and verify(tmp_path / "g", progress=False).ok
    assert _siblings(tmp_path) == []


def test_the_lock_is_freed_by_the_kernel_when_its_writer_is_killed(tmp_path):
    code = textwrap.dedent(f"""
        import os, signal
        from lightning_ooc.data.writer import DatasetWriter
        w = DatasetWriter({str(tmp_path / "g")!r}, num_nodes=3, num_features=2, num_classes=2)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    assert subprocess.run([sys.executable, "-c", code]).returncode == -signal.SIGKILL
    assert (tmp_path / ".g.lock").exists()
    _synth(tmp_path / "g")  # not refused; the dead writer's partial is swept
    assert _siblings(tmp_path) == []


# -- 3. a commit killed or interrupted halfway ------------------------------------------------------------------
def _kill_at(tmp_path, patch, seed=7):
    """Run an overwrite of ``g`` in a child that SIGKILLs itself where ``patch`` says."""
    code = textwrap.dedent("""
        import os, signal
        from lightning_ooc.data import commit, writer
        from lightning_ooc.data.synth import synthesize
        die = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)
    """) + textwrap.dedent(patch) + textwrap.dedent(f"""
        synthesize({str(tmp_path / "g")!r}, num_nodes=300, avg_degree=3, num_features=4, num_classes=2,
                   seed={seed}, overwrite=True, progress=False)
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == -signal.SIGKILL, r.stderr


def test_killed_after_the_exchange_the_path_holds_the_new_dataset(tmp_path):
    _synth(tmp_path / "g")
    _kill_at(tmp_path, "writer._remove_tree = die\n")
    assert _seed(tmp_path / "g") == 7 and verify(tmp_path / "g", progress=False).ok
    assert [n for n in _siblings(tmp_path) if ".partial-" in n]  # the replaced dataset, until the next writer
    _synth(tmp_path / "other")
    _synth(tmp_path / "g", seed=8, overwrite=True)
    assert _seed(tmp_path / "g") == 8 and _siblings(tmp_path) == []


def _no_exchange(src, dst, flags):
    raise OSError(errno.EINVAL, "not supported here")


def test_without_renameat2_an_overwrite_still_leaves_one_dataset(tmp_path, monkeypatch):
    monkeypatch.setattr(commit, "renameat2", _no_exchange)
    _synth(tmp_path / "g")
    _synth(tmp_path / "g", seed=4, overwrite=True)
    assert _seed(tmp_path / "g") == 4 and verify(tmp_path / "g", progress=False).ok
    assert _siblings(tmp_path) == []


def test_a_backup_left_by_a_killed_overwrite_is_reported_then_restored(tmp_path):
    _synth(tmp_path / "g")
    before = dataset_files_bytes(tmp_path / "g")
    # Without renameat2 the old dataset is moved aside first; die between the two renames.
    _kill_at(tmp_path, """
        def unsupported(src, dst, flags):
            raise OSError(22, "not supported here")
        commit.renameat2 = unsupported
        real_rename, calls = os.rename, []
        def rename(a, b):
            calls.append(1)
            if len(calls) == 3:  # 1: meta.json.pending in place, 2: old dataset to the backup, 3: new one in
                die()
            real_rename(a, b)
        os.rename = rename
    """)
    assert not (tmp_path / "g").exists()
    ((backup, pid),) = commit.backups(tmp_path / "g")
    with pytest.raises(lightning_ooc.DatasetNotFoundError, match=rf"{backup.name} holds the dataset that an inter"):
        lightning_ooc.open_dataset(tmp_path / "g")
    # The next writer puts it back before anything else; without --overwrite it then stops.
    with pytest.raises(lightning_ooc.DatasetWriteError, match=rf"already exists \(put back just now from {backup.name}"):
        _synth(tmp_path / "g", seed=5)
    assert dataset_files_bytes(tmp_path / "g") == before
    assert _siblings(tmp_path) == []


def test_a_stale_backup_beside_a_complete_dataset_is_swept(tmp_path):
    _synth(tmp_path / "g", seed=1)
    _synth(tmp_path / "x")
    os.rename(tmp_path / "x", tmp_path / f".g.old-{_dead_pid()}-0123abcd")
    _synth(tmp_path / "y")
    os.rename(tmp_path / "y", tmp_path / ".g.old-89abcdef")  # the name older releases used (no pid)
    _synth(tmp_path / "g", seed=2, overwrite=True)
    assert _seed(tmp_path / "g") == 2 and _siblings(tmp_path) == []


def _interrupt_self(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGINT)


def test_sigint_inside_the_commit_finishes_it_and_reports_success(tmp_path, monkeypatch, capsys):
    _synth(tmp_path / "g")
    real = writer._remove_tree

    def interrupted_removal(path):
        _interrupt_self()
        real(path)

    monkeypatch.setattr(writer, "_remove_tree", interrupted_removal)
    rc = cli.main(["synth", "--out", str(tmp_path / "g"), "--overwrite", "--seed", "6", *SMALL])
    err = capsys.readouterr().err
    assert rc == 0, err
    assert "SIGINT arrived while" in err and "holds the complete new dataset" in err
    assert _seed(tmp_path / "g") == 6 and _siblings(tmp_path) == []


def test_sigint_inside_the_commit_raises_after_it_for_api_callers(tmp_path, monkeypatch):
    _synth(tmp_path / "g")
    real = writer.fsync_dir
    monkeypatch.setattr(writer, "fsync_dir", lambda p: (_interrupt_self() if p == tmp_path else None, real(p)))
    with pytest.raises(lightning_ooc.InterruptedAfterCommit) as ei:
        _synth(tmp_path / "g", seed=6, overwrite=True)
    assert isinstance(ei.value, KeyboardInterrupt) and ei.value.path == tmp_path / "g"
    assert _seed(tmp_path / "g") == 6 and _siblings(tmp_path) == []


def test_sigint_before_the_commit_point_changes_nothing(tmp_path, monkeypatch, capsys):
    _synth(tmp_path / "g")
    before = dataset_files_bytes(tmp_path / "g")

    def interrupted_digest(meta):
        raise KeyboardInterrupt

    monkeypatch.setattr(writer, "meta_digest", interrupted_digest)
    rc = cli.main(["synth", "--out", str(tmp_path / "g"), "--overwrite", "--seed", "6", *SMALL])
    assert rc == 130 and "interrupted" in capsys.readouterr().err
    assert dataset_files_bytes(tmp_path / "g") == before and _siblings(tmp_path) == []


def test_sigterm_inside_the_commit_of_the_cli_reports_success(tmp_path, monkeypatch, capsys):
    _synth(tmp_path / "g")
    real = writer._remove_tree

    def terminated_removal(path):
        os.kill(os.getpid(), signal.SIGTERM)
        real(path)

    monkeypatch.setattr(writer, "_remove_tree", terminated_removal)
    previous = signal.getsignal(signal.SIGTERM)
    try:
        rc = cli.main(["synth", "--out", str(tmp_path / "g"), "--overwrite", "--seed", "6", *SMALL])
    finally:
        signal.signal(signal.SIGTERM, previous)
    err = capsys.readouterr().err
    assert rc == 0 and "SIGTERM arrived while" in err and "holds the complete new dataset" in err, err
    assert _seed(tmp_path / "g") == 6 and _siblings(tmp_path) == []


def test_an_ignored_sigint_stays_ignored_through_the_commit(tmp_path, monkeypatch):
    _synth(tmp_path / "g")
    monkeypatch.setattr(writer, "fsync_dir", lambda p, real=writer.fsync_dir: (_interrupt_self(), real(p)))
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        _synth(tmp_path / "g", seed=6, overwrite=True)  # no InterruptedAfterCommit
    finally:
        signal.signal(signal.SIGINT, previous)
    assert _seed(tmp_path / "g") == 6


def test_a_users_sigterm_handler_runs_after_the_commit(tmp_path, monkeypatch):
    _synth(tmp_path / "g")
    seen = []
    monkeypatch.setattr(writer, "_remove_tree", lambda p, real=writer._remove_tree: (os.kill(os.getpid(),
                        signal.SIGTERM), seen.append("removed"), real(p)))  # fmt: skip
    previous = signal.signal(signal.SIGTERM, lambda s, f: seen.append(("handler", _seed(tmp_path / "g"))))
    try:
        _synth(tmp_path / "g", seed=6, overwrite=True)
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert seen == ["removed", ("handler", 6)]  # held until the commit was done, then delivered


def test_names_like_ours_that_are_not_ours_are_never_touched(tmp_path):
    _synth(tmp_path / "g")
    (tmp_path / ".g.old-keep").mkdir()
    (tmp_path / ".g.old-keep" / "precious.txt").write_text("x")
    _synth(tmp_path / "mine")
    os.rename(tmp_path / "mine", tmp_path / ".g.old-mine")  # a user's own copy, by a name of their choosing
    (tmp_path / ".g.old-0123abcd").symlink_to("/nonexistent")  # a dangling link named like an old backup
    (tmp_path / ".g.partial-notapid").mkdir()
    _synth(tmp_path / "g", seed=2, overwrite=True)
    assert (tmp_path / ".g.old-keep" / "precious.txt").exists() and _seed(tmp_path / ".g.old-mine") == 0
    assert os.path.islink(tmp_path / ".g.old-0123abcd") and (tmp_path / ".g.partial-notapid").is_dir()
    assert _seed(tmp_path / "g") == 2


def test_a_backup_holding_foreign_files_is_kept(tmp_path):
    _synth(tmp_path / "x")
    (tmp_path / "x" / "notes.txt").write_text("x")
    os.rename(tmp_path / "x", tmp_path / f".g.old-{_dead_pid()}-0123abcd")
    _synth(tmp_path / "g")  # the target is missing, but this is not a dataset of ours alone: not restored
    assert _seed(tmp_path / "g") == 0 and (tmp_path / next(n for n in _siblings(tmp_path)) / "notes.txt").exists()


@pytest.mark.parametrize("pid", ["1", "self"])
def test_a_backup_is_restored_whatever_process_has_its_pid_now(tmp_path, pid):
    # Under the lock no writer of this release is replacing the target, so a backup is stale even when
    # its pid belongs to a live process now (pid 1 of a container, or this long-lived process).
    _synth(tmp_path / "x", seed=3)
    os.rename(tmp_path / "x", tmp_path / f".g.old-{os.getpid() if pid == 'self' else 1}-0123abcd")
    with pytest.raises(lightning_ooc.DatasetWriteError, match="put back just now"):
        _synth(tmp_path / "g")
    assert _seed(tmp_path / "g") == 3 and _siblings(tmp_path) == []


def test_a_failed_rename_in_the_fallback_puts_the_old_dataset_back(tmp_path, monkeypatch):
    _synth(tmp_path / "g")
    before = dataset_files_bytes(tmp_path / "g")
    monkeypatch.setattr(commit, "renameat2", _no_exchange)
    real, calls = os.rename, []

    def rename(a, b):
        calls.append((a, b))
        if len(calls) == 3:  # the new dataset into place
            raise OSError(errno.EIO, "I/O error")
        real(a, b)

    monkeypatch.setattr(os, "rename", rename)
    with pytest.raises(OSError, match="I/O error"):
        _synth(tmp_path / "g", seed=5, overwrite=True)
    monkeypatch.setattr(os, "rename", real)
    assert dataset_files_bytes(tmp_path / "g") == before and _siblings(tmp_path) == []


def test_sigterm_while_writing_says_so(tmp_path, monkeypatch, capsys):
    def terminated(meta):
        os.kill(os.getpid(), signal.SIGTERM)
        return "x"

    monkeypatch.setattr(writer, "meta_digest", terminated)
    previous = signal.getsignal(signal.SIGTERM)
    try:
        rc = cli.main(["synth", "--out", str(tmp_path / "g"), *SMALL])
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert rc == 143 and "terminated (SIGTERM)" in capsys.readouterr().err
    assert not (tmp_path / "g").exists() and _siblings(tmp_path) == []

"""Issue 30: resuming from a read-only checkpoint directory works again (the shared lock had started creating its lock
file there, which a read-only directory refuses). A reader that cannot write in the directory locks it without
creating anything; a writer still excludes it. Read-only is simulated by refusing the lock file's creation (EROFS, as
a read-only mount does) since root ignores permission bits; where the tests do not run as root, a chmod 0555 copy is
resumed from too."""
from __future__ import annotations

import errno
import os
import shutil
import stat
from pathlib import Path

import pytest
from typer.testing import CliRunner

import runtime.dirlock as dirlock
from planner.cli import app
from runtime.dirlock import LOCK_NAME, DirLock

REPO = Path(__file__).resolve().parents[2]
PP2 = REPO / "plans" / "examples" / "tiny-vlm-pp2.json"
runner = CliRunner()


def _read_only(monkeypatch, directory: Path) -> None:
    """Opening a file for writing inside `directory` fails as on a read-only mount."""
    real = os.open

    def fake(path, flags, *args, **kwargs):
        if Path(path).parent == directory and flags & (os.O_CREAT | os.O_WRONLY | os.O_RDWR):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        return real(path, flags, *args, **kwargs)

    monkeypatch.setattr(dirlock.os, "open", fake)


def test_a_reader_locks_a_read_only_directory_without_writing_there(tmp_path, monkeypatch):
    _read_only(monkeypatch, tmp_path)
    with DirLock(tmp_path, "--resume", shared=True) as a, DirLock(tmp_path, "--resume", shared=True) as b:
        assert a.held and b.held  # readers share
        assert not (tmp_path / LOCK_NAME).exists()
        monkeypatch.undo()  # a writer that can write there (another user, the mount made writable) is excluded
        with pytest.raises(Exception, match="in use by another mmplan run"):
            DirLock(tmp_path, "--checkpoint-dir").acquire()
        assert not (tmp_path / LOCK_NAME).exists()  # the refused writer removed what it created
        _read_only(monkeypatch, tmp_path)
    monkeypatch.undo()
    with DirLock(tmp_path, "--checkpoint-dir") as writer:
        assert writer.held
        _read_only(monkeypatch, tmp_path)
        with pytest.raises(Exception, match="in use by another mmplan run"):
            DirLock(tmp_path, "--resume", shared=True).acquire()  # and a writer excludes such readers


def test_an_existing_lock_file_is_shared_read_only(tmp_path, monkeypatch):
    (tmp_path / LOCK_NAME).write_text("")
    _read_only(monkeypatch, tmp_path)
    with DirLock(tmp_path, "--resume", shared=True) as lock:
        assert lock.held


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    ck = tmp_path_factory.mktemp("ck") / "ck"
    res = runner.invoke(app, ["run", str(PP2), "--steps", "2", "--checkpoint-every", "2", "--checkpoint-dir", str(ck), "--quiet"])
    assert res.exit_code == 0, res.output
    return ck


def test_run_resumes_from_a_read_only_checkpoint_directory(ckpt, tmp_path, monkeypatch):
    ck = Path(shutil.copytree(ckpt, tmp_path / "ck"))
    before = sorted(p.name for p in ck.iterdir())
    _read_only(monkeypatch, ck)
    res = runner.invoke(app, ["run", str(PP2), "--steps", "3", "--resume", str(ck), "--quiet"])
    assert res.exit_code == 0, res.output
    assert sorted(p.name for p in ck.iterdir()) == before


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes in a 0555 directory")
def test_run_resumes_from_a_chmod_read_only_directory(ckpt, tmp_path):
    ck = Path(shutil.copytree(ckpt, tmp_path / "ck"))
    for p in [ck, *ck.rglob("*")]:
        p.chmod(stat.S_IRUSR | stat.S_IXUSR | (stat.S_IRGRP | stat.S_IROTH) | (stat.S_IXUSR if p.is_dir() else 0))
    try:
        res = runner.invoke(app, ["run", str(PP2), "--steps", "3", "--resume", str(ck), "--quiet"])
        assert res.exit_code == 0, res.output
    finally:
        for p in [ck, *ck.rglob("*")]:
            p.chmod(0o755)

"""Rank processes keep the host memory they free (runtime/host_memory.py): a step that allocates and frees the same
tensors again takes no page faults. Tested is what mmplan controls: the mallopt settings it applies, that glibc accepts
them, that every launched rank runs so, and that a user's own malloc settings win."""

import platform
import subprocess
import sys
from pathlib import Path

import pytest

from runtime import host_memory
from runtime.host_memory import user_tuned
from runtime.launch import RankContext, launch

ROOT = Path(__file__).resolve().parents[2]

glibc = pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc's malloc")


class _RecordingLibc:
    """A C library whose mallopt records what it is asked and accepts it (as glibc does for these values)."""

    def __init__(self, *_args):
        self.calls: list[tuple[int, int]] = []
        outer = self

        class Mallopt:
            argtypes = restype = None

            def __call__(self, param: int, value: int) -> int:
                outer.calls.append((param, value))
                return 1

        self.mallopt = Mallopt()


def test_the_settings_mmplan_applies_are_its_own(monkeypatch):
    """What mmplan controls: the mallopt(3) calls it makes (not how many page faults the host's allocator then
    takes: that depends on the C library's version and the machine, issue 30)."""
    libc = _RecordingLibc()
    monkeypatch.setattr(host_memory.ctypes, "CDLL", lambda *_a: libc)
    monkeypatch.setattr(host_memory, "_applied", None)
    for name in (*host_memory._USER_VARS, "GLIBC_TUNABLES"):
        monkeypatch.delenv(name, raising=False)
    assert host_memory.keep_freed_memory() is True
    assert libc.calls == [(host_memory.M_MMAP_THRESHOLD, 32 * 2**20), (host_memory.M_TRIM_THRESHOLD, 2**30),
                          (host_memory.M_TOP_PAD, 16 * 2**20)]
    assert host_memory.keep_freed_memory() is True and len(libc.calls) == 3  # once per process


def test_a_user_tuned_malloc_is_left_alone(monkeypatch):
    libc = _RecordingLibc()
    monkeypatch.setattr(host_memory.ctypes, "CDLL", lambda *_a: libc)
    monkeypatch.setattr(host_memory, "_applied", None)
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "0")
    assert host_memory.keep_freed_memory() is False and libc.calls == []


@glibc
@pytest.mark.skipif(user_tuned(), reason="this environment tunes glibc's malloc itself")
def test_glibc_accepts_the_settings():
    """The real C library takes every value (mallopt returns 1 for each), in a process of its own."""
    code = "from runtime.host_memory import keep_freed_memory; print(keep_freed_memory())"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split()[-1] == "True", out


def _applied(ctx: RankContext, _payload) -> bool | None:
    from runtime import host_memory

    return host_memory._applied


@glibc
@pytest.mark.skipif(user_tuned(), reason="this environment tunes glibc's malloc itself")
def test_every_launched_rank_keeps_its_freed_memory():
    assert launch(_applied, 2, None, timeout_s=60, op_timeout_s=30) == [True, True]


def test_the_users_own_malloc_settings_win():
    assert user_tuned({"MALLOC_TRIM_THRESHOLD_": "0"})
    assert user_tuned({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=0"})
    assert not user_tuned({"GLIBC_TUNABLES": "glibc.rtld.optional_static_tls=512"})
    assert not user_tuned({})

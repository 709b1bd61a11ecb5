"""Rank processes keep the host memory they free (runtime/host_memory.py): a step that allocates and frees the same
tensors again takes no page faults, every launched rank runs so, and a user's own malloc settings win."""

import platform
import subprocess
import sys
from pathlib import Path

import pytest

from runtime.host_memory import user_tuned
from runtime.launch import RankContext, launch

ROOT = Path(__file__).resolve().parents[2]

# three "steps", each writing 64 tensors of 1 MiB and freeing them all (as activations are), after two warm-up
# steps: the minor page faults they take
_STEPS = """
import resource, sys, torch
if sys.argv[1] == "keep":
    from runtime.host_memory import keep_freed_memory
    assert keep_freed_memory()
def step():
    xs = [torch.ones(2**18) for _ in range(64)]
    del xs
step(); step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(3):
    step()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""

glibc = pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc's malloc")


def _faults(mode: str, env: dict[str, str] | None = None) -> int:
    out = subprocess.run([sys.executable, "-c", _STEPS, mode], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env=env, check=True)
    return int(out.stdout.split()[-1])


@glibc
def test_repeated_steps_take_no_page_faults_with_the_memory_kept():
    import os

    pages = 3 * 64 * 2**20 // 4096  # what the three steps write
    kept = _faults("keep")
    default = _faults("default", {**os.environ, "GLIBC_TUNABLES": "glibc.malloc.check=0"})  # glibc as it comes
    assert kept < 0.05 * pages, kept
    assert default > 0.2 * pages, default  # what the setting saves: glibc returned the freed heap and faulted it back


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

"""Tests of launch(): results in rank order, root-cause failures, dead and hung ranks, no orphans, torchrun mode."""

import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from plans.errors import MmplanError
from runtime.launch import RankContext, RankFailure, launch


def _alive(pid: int) -> bool:
    """True for a running process (a zombie, which no parent reaped, counts as dead)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def _record_pid(ctx: RankContext, folder: str, name: str = "rank") -> None:
    # written under another name, then renamed: a reader polling the folder never sees a half-written file (a test
    # read one empty under load: int('') failed)
    tmp = Path(folder, f".{name}-{ctx.rank}.tmp")
    tmp.write_text(str(os.getpid()))
    os.replace(tmp, Path(folder, f"{name}-{ctx.rank}.pid"))


def _recorded_pids(folder: Path) -> list[int]:
    return [int(p.read_text()) for p in folder.glob("*.pid")]


def _assert_no_survivors(folder: Path, expected: int) -> None:
    pids = _recorded_pids(folder)
    assert len(pids) == expected
    deadline = time.monotonic() + 2.0
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [pid for pid in pids if _alive(pid)]


def all_reduce_worker(ctx: RankContext, payload):
    value = torch.tensor([float(ctx.rank + 1)], dtype=torch.float64)
    dist.all_reduce(value)
    return ctx.rank, ctx.world_size, value.item(), torch.get_num_threads(), str(ctx.device), payload


@pytest.mark.parametrize("world_size", [2, 4])
def test_all_reduce_results_in_rank_order(world_size):
    results = launch(all_reduce_worker, world_size, payload="hi", timeout_s=30)
    total = world_size * (world_size + 1) / 2
    assert results == [(r, world_size, total, 1, "cpu", "hi") for r in range(world_size)]


def test_spawn_fallback_runs_the_same_worker():
    assert launch(all_reduce_worker, 2, payload=None, start_method="spawn", timeout_s=60)[1][2] == 3.0


def raising_worker(ctx: RankContext, folder: str):
    _record_pid(ctx, folder)
    dist.barrier()
    if ctx.rank == 1:
        raise ValueError("boom at step 3")
    dist.all_reduce(torch.ones(1))  # the peers block here and then fail with a connection error
    return ctx.rank


def test_raising_rank_is_reported_not_the_peers_connection_errors(tmp_path):
    start = time.monotonic()
    with pytest.raises(RankFailure) as info:
        launch(raising_worker, 4, str(tmp_path), timeout_s=60, op_timeout_s=30)
    elapsed = time.monotonic() - start
    message = str(info.value)
    assert "rank 1" in message and "ValueError" in message and "boom at step 3" in message, message
    assert "\n" not in message and "onnection" not in message
    assert info.value.rank == 1 and "boom at step 3" in info.value.remote_traceback
    assert elapsed < 10, f"failure took {elapsed:.1f} s to report"
    _assert_no_survivors(tmp_path, 4)


def exiting_worker(ctx: RankContext, folder: str):
    _record_pid(ctx, folder)
    dist.barrier()
    if ctx.rank == 1:
        os._exit(3)
    dist.all_reduce(torch.ones(1))
    return ctx.rank


def test_rank_dying_without_an_error_is_named_with_its_exit_code(tmp_path):
    with pytest.raises(RankFailure, match=r"rank 1 exited with code 3") as info:
        launch(exiting_worker, 2, str(tmp_path), timeout_s=60, op_timeout_s=30)
    assert info.value.rank == 1
    _assert_no_survivors(tmp_path, 2)


def hanging_worker(ctx: RankContext, folder: str):
    _record_pid(ctx, folder)
    if ctx.rank == 1:
        grandchild = subprocess.Popen(["sleep", "600"])
        Path(folder, "grandchild.pid").write_text(str(grandchild.pid))
        time.sleep(3600)
    return ctx.rank


def test_hanging_rank_times_out_and_leaves_no_process_behind(tmp_path):
    start = time.monotonic()
    with pytest.raises(RankFailure, match=r"timed out after 4 s; ranks still running: 1$"):
        launch(hanging_worker, 2, str(tmp_path), timeout_s=4)
    assert 4 <= time.monotonic() - start < 10
    _assert_no_survivors(tmp_path, 3)  # both ranks and the hanging rank's own child


def unpicklable_worker(ctx: RankContext, payload):
    return lambda: ctx.rank


def test_unpicklable_result_names_the_rank():
    with pytest.raises(RankFailure, match=r"rank 0 failed: .*(Pickl|pickle)"):
        launch(unpicklable_worker, 1, timeout_s=30)


@pytest.mark.parametrize(
    "kwargs", [{"world_size": 0}, {"world_size": 2, "timeout_s": 0}, {"world_size": 2, "start_method": "thread"}]
)
def test_bad_arguments_are_one_line_errors(kwargs):
    with pytest.raises(MmplanError):
        launch(all_reduce_worker, **kwargs)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def torchrun_env(monkeypatch):
    for name, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("MASTER_PORT", str(_free_port()))


def in_process_worker(ctx: RankContext, payload):
    value = torch.tensor([5.0])
    dist.all_reduce(value)
    return os.getpid(), ctx, dist.get_world_size(), value.item(), payload


def test_torchrun_env_runs_this_rank_in_process(torchrun_env):
    [(pid, ctx, world, value, payload)] = launch(in_process_worker, 1, payload=7)
    assert pid == os.getpid() and world == 1 and value == 5.0 and payload == 7
    assert ctx == RankContext(rank=0, world_size=1, backend="gloo", device=torch.device("cpu"), local_rank=0)
    assert not dist.is_initialized()


def failing_in_process_worker(ctx: RankContext, payload):
    raise KeyError("missing shard")


def test_torchrun_env_failure_names_rank_and_error(torchrun_env):
    with pytest.raises(RankFailure, match=r"rank 0 failed: KeyError: 'missing shard'"):
        launch(failing_in_process_worker, 1)
    assert not dist.is_initialized()


def test_torchrun_env_world_size_mismatch(torchrun_env):
    with pytest.raises(MmplanError, match=r"1 ranks.*world_size=2"):
        launch(in_process_worker, 2)


def sleeping_worker(ctx: RankContext, folder: str):
    _record_pid(ctx, folder)
    time.sleep(3600)


def test_keyboard_interrupt_in_the_parent_kills_the_ranks(tmp_path, monkeypatch):
    import runtime.launch as launch_module

    def interrupted_watch(procs, run_dir, timeout_s):
        deadline = time.monotonic() + 10
        while len(_recorded_pids(tmp_path)) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        raise KeyboardInterrupt

    monkeypatch.setattr(launch_module, "_watch", interrupted_watch)
    with pytest.raises(KeyboardInterrupt):
        launch(sleeping_worker, 2, str(tmp_path), timeout_s=30)
    _assert_no_survivors(tmp_path, 2)


def stopping_worker(ctx: RankContext, folder: str):
    _record_pid(ctx, folder)
    if ctx.rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)  # stopped, not dead: it never answers and never records an error
    dist.all_reduce(torch.ones(1))


def test_a_stopped_rank_is_blamed_not_the_peer_that_timed_out_waiting_for_it(tmp_path):
    with pytest.raises(RankFailure) as err:
        launch(stopping_worker, 2, str(tmp_path), timeout_s=60, op_timeout_s=2)
    assert err.value.rank == 1
    assert str(err.value).startswith("rank 1 was stopped by a signal") and "rank 0 then failed waiting for it" in str(err.value)
    _assert_no_survivors(tmp_path, 2)


def user_error_worker(ctx: RankContext, payload):
    raise MmplanError("training diverged at step 3: the loss is nan")


def test_a_ranks_user_error_is_reported_as_its_own_sentence():
    with pytest.raises(RankFailure, match=r"^training diverged at step 3: the loss is nan$"):
        launch(user_error_worker, 2, timeout_s=30)


def test_without_a_deadline_a_stopped_rank_is_still_caught_by_the_bounded_waits(tmp_path):
    """timeout_s=None (mmplan run's default): no wall-clock limit, yet a hang ends the run within op_timeout_s."""
    start = time.monotonic()
    with pytest.raises(RankFailure) as err:
        launch(stopping_worker, 2, str(tmp_path), timeout_s=None, op_timeout_s=2)
    assert err.value.rank == 1 and str(err.value).startswith("rank 1 was stopped by a signal")
    assert time.monotonic() - start < 30
    _assert_no_survivors(tmp_path, 2)

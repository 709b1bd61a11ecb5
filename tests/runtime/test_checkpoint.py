"""Checkpoints round-trip exactly, survive interrupted writes, refuse damaged files, and keep the last two."""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from plans.errors import MmplanError
from runtime.checkpoint import (
    MANIFEST,
    adam_state_by_name,
    block_params,
    latest_checkpoint,
    load_adam_state_by_name,
    load_block,
    rng_state,
    save_checkpoint,
    set_rng_state,
    step_dir,
    write_block_files,
    write_manifest,
)

REPO = Path(__file__).resolve().parents[2]


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 4)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x.pow(2).mean()


def trained(steps: int = 2, seed: int = 0) -> tuple[Net, torch.optim.Adam]:
    torch.manual_seed(seed)
    net = Net()
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    for _ in range(steps):
        net(torch.randn(4, 8)).backward()
        opt.step()
        opt.zero_grad()
    return net, opt


def blocks_of(net: Net) -> dict[str, nn.Module]:
    return {f"layers.{i}": m for i, m in enumerate(net.layers)}


def save(root: Path, step: int, net: Net, opt: torch.optim.Adam, **kw):
    named = dict(net.named_parameters())
    return save_checkpoint(root, step, block_params(blocks_of(net)), adam_state_by_name(opt, named), data_position=step * 32, **kw)


def test_round_trip_params_optimizer_rng_and_data_position(tmp_path):
    net, opt = trained()
    random.random()
    np.random.rand(3)
    torch.rand(5)
    written = save(tmp_path, 2, net, opt)
    want_next = (torch.rand(3), random.random(), np.random.rand(2))
    set_rng_state(written.rng_for(0))  # also rewinds this process: restore, then draw the same numbers again

    manifest = latest_checkpoint(tmp_path)
    assert manifest is not None and manifest.step == 2 and manifest.data_position == 64
    assert set(manifest.blocks) == {"layers.0", "layers.1", "layers.2"}
    fresh, fresh_opt = trained(steps=0, seed=123)
    fresh_named = dict(fresh.named_parameters())
    for block in manifest.blocks:
        params, state = load_block(manifest, block)
        with torch.no_grad():
            for n, t in params.items():
                fresh_named[n].copy_(t)
        load_adam_state_by_name(fresh_opt, fresh_named, state)
    assert all(torch.equal(a, b) for a, b in zip(net.state_dict().values(), fresh.state_dict().values()))
    old, new = adam_state_by_name(opt, dict(net.named_parameters())), adam_state_by_name(fresh_opt, fresh_named)
    assert old.keys() == new.keys()
    assert all(torch.equal(old[n][k], new[n][k]) for n in old for k in old[n])
    set_rng_state(manifest.rng_for(0))
    got_next = (torch.rand(3), random.random(), np.random.rand(2))
    assert torch.equal(want_next[0], got_next[0]) and want_next[1] == got_next[1] and np.array_equal(want_next[2], got_next[2])
    # continuing to train from the restored state is bitwise the uninterrupted run
    x = torch.randn(4, 8)
    for m, o in ((net, opt), (fresh, fresh_opt)):
        m(x).backward()
        o.step()
    assert all(torch.equal(a, b) for a, b in zip(net.state_dict().values(), fresh.state_dict().values()))


def test_ranks_write_their_blocks_then_one_writes_the_manifest(tmp_path):
    """The multi-rank protocol, and resuming under another cut: blocks written by two 'ranks', read by one."""
    net, opt = trained()
    named = dict(net.named_parameters())
    state = adam_state_by_name(opt, named)
    params = block_params(blocks_of(net))
    rank0 = write_block_files(tmp_path, 5, {b: params[b] for b in ("layers.0", "layers.1")}, state)
    rank1 = write_block_files(tmp_path, 5, {"layers.2": params["layers.2"]}, state)
    assert latest_checkpoint(tmp_path) is None  # no manifest yet: not a checkpoint
    write_manifest(tmp_path, 5, {**rank0, **rank1}, rng={0: rng_state(), 1: rng_state()}, data_position=7)
    manifest = latest_checkpoint(tmp_path)
    assert manifest.rng_for(1) == manifest.rng_for(0) and manifest.rng_for(3) == manifest.rng_for(0)
    for block, want in params.items():
        got, got_state = load_block(manifest, block)
        assert got.keys() == want.keys() and all(torch.equal(got[n], want[n]) for n in want)
        assert got_state.keys() == want.keys()
    # the manifest can also be completed from block names (files hashed from disk)
    write_block_files(tmp_path, 6, params, state)
    assert write_manifest(tmp_path, 6, list(params), rng={0: rng_state()}, data_position=8).files == latest_checkpoint(tmp_path).files


def test_interrupted_write_is_ignored_and_the_previous_checkpoint_used(tmp_path):
    net, opt = trained()
    save(tmp_path, 10, net, opt)
    net2, opt2 = trained(steps=3)
    write_block_files(tmp_path, 20, block_params(blocks_of(net2)), adam_state_by_name(opt2, dict(net2.named_parameters())))
    (step_dir(tmp_path, 20) / ".layers.1.pt.tmp-999").write_bytes(b"half a file")
    (step_dir(tmp_path, 30)).mkdir()
    (step_dir(tmp_path, 30) / ".layers.0.pt.tmp-999").write_bytes(b"\0" * 10)
    manifest = latest_checkpoint(tmp_path)
    assert manifest.step == 10
    params, _ = load_block(manifest, "layers.0")
    assert torch.equal(params["layers.0.weight"], net.layers[0].weight)
    # the next complete checkpoint removes the leftovers
    save(tmp_path, 20, net2, opt2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000010", "step-000020"]
    assert not list(step_dir(tmp_path, 20).glob(".*"))


def test_truncated_tampered_and_missing_files_are_refused(tmp_path):
    net, opt = trained()
    save(tmp_path, 40, net, opt)
    f = step_dir(tmp_path, 40) / "layers.1.pt"
    good = f.read_bytes()

    f.write_bytes(good[: len(good) // 2])
    with pytest.raises(MmplanError, match=rf"checkpoint {f} is corrupt: .*truncated.*refusing to resume"):
        latest_checkpoint(tmp_path)
    manifest = latest_checkpoint(tmp_path, verify=False)
    with pytest.raises(MmplanError, match=rf"checkpoint {f} is corrupt"):
        load_block(manifest, "layers.1")

    flipped = bytearray(good)
    flipped[len(flipped) // 2] ^= 0x01
    f.write_bytes(bytes(flipped))
    with pytest.raises(MmplanError, match=rf"checkpoint {f} is corrupt: sha256 mismatch; refusing to resume"):
        latest_checkpoint(tmp_path)
    with pytest.raises(MmplanError, match="sha256 mismatch"):
        load_block(manifest, "layers.1")

    f.unlink()
    with pytest.raises(MmplanError, match=rf"checkpoint {f} is missing"):
        latest_checkpoint(tmp_path)

    f.write_bytes(good)
    m = step_dir(tmp_path, 40) / MANIFEST
    m.write_text(m.read_text()[:-20])
    with pytest.raises(MmplanError, match=rf"checkpoint manifest {m} is unreadable"):
        latest_checkpoint(tmp_path)
    with pytest.raises(MmplanError, match="has no block 'encoder.0'"):
        load_block(latest_checkpoint(tmp_path, verify=False, skip_corrupt=True) or manifest, "encoder.0")


def test_a_damaged_newest_checkpoint_can_be_skipped_explicitly(tmp_path):
    net, opt = trained()
    save(tmp_path, 1, net, opt)
    save(tmp_path, 2, net, opt)
    (step_dir(tmp_path, 2) / "layers.0.pt").write_bytes(b"junk")
    with pytest.raises(MmplanError, match="step-000002/layers.0.pt is corrupt"):
        latest_checkpoint(tmp_path)
    assert latest_checkpoint(tmp_path, skip_corrupt=True).step == 1


def test_keeps_the_last_two(tmp_path):
    net, opt = trained()
    for step in (3, 6, 9, 12):
        save(tmp_path, step, net, opt)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000009", "step-000012"]
    assert latest_checkpoint(tmp_path).step == 12


_WRITER = textwrap.dedent("""
    import sys, torch
    from runtime.checkpoint import save_checkpoint
    root = sys.argv[1]
    blocks = {f"b{i}": {f"b{i}.w": torch.full((256, 1024), float(i))} for i in range(4)}  # 1 MB each
    print("ready", flush=True)
    step = 0
    while True:
        step += 1
        for b in blocks.values():
            for t in b.values():
                t.add_(1.0)  # block i holds i + step everywhere
        state = {n: {"exp_avg": t * 0.5} for b in blocks.values() for n, t in b.items()}
        save_checkpoint(root, step, blocks, state, data_position=step)
""")


def test_sigkill_while_writing_leaves_a_loadable_checkpoint(tmp_path):
    """Kill a process that writes checkpoints back to back at random moments: what remains always loads."""
    rnd = random.Random(0)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    root = tmp_path / "ckpt"
    seen = []
    for _ in range(2):
        proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(root)], stdout=subprocess.PIPE, env=env)
        assert proc.stdout.readline().strip() == b"ready"
        deadline = time.monotonic() + 60  # a loaded machine: the first checkpoint lands before the kill is timed
        while latest_checkpoint(root) is None and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
        time.sleep(0.3 + rnd.random() * 0.5)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        manifest = latest_checkpoint(root)
        assert manifest is not None
        assert manifest.data_position == manifest.step
        for i, block in enumerate(manifest.blocks):
            params, state = load_block(manifest, block)
            (name, w), = params.items()
            assert torch.all(w == i + manifest.step) and torch.equal(state[name]["exp_avg"], w * 0.5)  # one consistent step
        assert len([p for p in root.iterdir() if (p / MANIFEST).is_file()]) <= 3
        seen.append(manifest.step)
    assert all(s >= 1 for s in seen)
    json.loads((Path(latest_checkpoint(root).path) / MANIFEST).read_text())

"""Issue 30: a profile's size is bounded and the work on it near-linear in blocks. More blocks than MAX_BLOCKS and a
wrong fingerprint are refused before the schema validation (seconds on a large file); the solver's segment figures
are bounded in size whatever the block count (a 3,000-block profile ran out of memory, a 10,000-block one grew to
20 GB); `show` is linear. No test here depends on the machine's speed: sizes, counts and CPU-time ratios."""
from __future__ import annotations

import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import plans.graph as graph
from planner.solver.segments import MAX_CUT_POSITIONS, Segments, cut_positions
from planner.solver.space import Setting
from planner.solver.structure import profile_units
from plans.errors import FormatError
from plans.graph import load_profile, save_profile
from plans.limits import MAX_BLOCKS
from plans.serial import to_data
from tests.synthetic_profile import wide_profile

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    from planner.profiler.profile import profile_model
    from runtime.source import resolve

    return profile_model(resolve("tiny-vlm"))


def _no_schema(monkeypatch):
    def fail(*_a, **_k):
        raise AssertionError("the full schema validation ran before the cheap check")

    monkeypatch.setattr(graph, "validate", fail)


def test_more_blocks_than_the_bound_are_refused_with_the_figure_before_the_schema(base, monkeypatch):
    data = to_data(base)
    data["blocks"] = data["blocks"] * (MAX_BLOCKS // len(data["blocks"]) + 1)
    _no_schema(monkeypatch)
    with pytest.raises(FormatError, match=rf"has {len(data['blocks']):,} blocks, more than the {MAX_BLOCKS:,} mmplan plans for"):
        graph.profile_from_data(data, "profile big.json")


def test_a_wrong_fingerprint_is_refused_before_the_schema(base, monkeypatch):
    data = to_data(base)
    data["fingerprint"] = "0" * 16
    data["blocks"][0]["params"] = "not a number"  # the schema would name this; the fingerprint is checked first
    _no_schema(monkeypatch)
    with pytest.raises(FormatError, match="fingerprint 0000000000000000 does not match its blocks"):
        graph.profile_from_data(data, "profile")


def test_identical_blocks_are_validated_once_and_errors_keep_their_index(base):
    wide = to_data(wide_profile(base, 400))
    wide["blocks"][321]["params"] = 1.5  # an integer field written as a float (issue 30's "dp": 1.0)
    with pytest.raises(FormatError, match=r"^profile: field blocks/321/params: 1.5 is not of type 'integer'$"):
        graph.profile_from_data(wide, "profile")


def test_cut_positions_bound_the_segment_figures(base):
    assert list(cut_positions(10)) == list(range(11))
    pos = cut_positions(5000)
    assert pos[0] == 0 and pos[-1] == 5000 and len(pos) == MAX_CUT_POSITIONS + 1 and np.all(np.diff(pos) > 0)
    profile = wide_profile(base, 3000)
    unit = max(profile_units(profile, "chain"), key=lambda u: len(u.blocks))
    from cost_models.cluster_spec import parse_cluster

    seg = Segments(unit, Setting(parse_cluster("8xh100-sxm"), 64), 1, 1, 0, 8)
    assert seg.params.shape == (len(seg.positions),) * 2 and len(seg.positions) <= MAX_CUT_POSITIONS + 1
    # the figures stay exact sums over the blocks between two positions
    whole = sum(b.params for b in unit.blocks)
    assert seg.params[0, -1] == pytest.approx(whole, rel=1e-12)


def _cpu(fn) -> float:
    t0 = time.process_time()
    fn()
    return time.process_time() - t0


def test_show_is_near_linear_in_blocks(base):
    """4x the blocks takes well under 16x the CPU time (quadratic: 133 s at 10,000 blocks)."""
    from rich.console import Console

    from planner.profiler.show import render_profile

    small, large = wide_profile(base, 1000), wide_profile(base, 4000)
    console = Console(file=open("/dev/null", "w"), width=120)
    render_profile(small, console)  # warm-up (imports, caches)
    # the least of three CPU times each: one run of the small case can be cut short or stretched by a collection
    ratio = min(_cpu(lambda: render_profile(large, console)) for _ in range(3)) / max(
        min(_cpu(lambda: render_profile(small, console)) for _ in range(3)), 1e-3)
    assert ratio < 9, ratio


def test_solving_3000_blocks_stays_small(base, tmp_path):
    """Bounded memory whatever the block count (before: a MemoryError after 80 s at 3,000 blocks); the peak resident
    size of the solving process, not its time, is what is checked (--time-limit keeps the test short: the segment
    figures are built before the first plan). Measured on a 2-core box at load 10: 10,000 blocks solve without a
    time limit in 66 s at 385 MB."""
    path = tmp_path / "wide.json"
    save_profile(wide_profile(base, 3000), path)
    code = ("import resource, sys; from planner.cli import app\n"
            "try:\n    app(sys.argv[1:])\nexcept SystemExit as e:\n    code = e.code\n"
            "print('RSS', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss); sys.exit(code)")
    out = subprocess.run([sys.executable, "-c", code, "solve", str(path), "--cluster", "8xh100-sxm", "--global-batch", "64",
                          "-o", str(tmp_path / "plan.json"), "--quiet", "--time-limit", "30"], cwd=ROOT, capture_output=True, text=True,
                         timeout=1800)
    assert out.returncode == 0, out.stderr[-2000:]
    rss_kib = int(out.stdout.split("RSS")[-1].split()[0])
    assert rss_kib < 1.5 * 2**20, rss_kib  # < 1.5 GiB
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert len(plan["flow"]["blocks"]) == 3000
    assert load_profile(path).fingerprint == plan["profile"]["fingerprint"]

"""bench/hetero_bench.py: the issue's cases are all there, and one row runs end to end (fast: a tiny zoo model)."""
from __future__ import annotations

import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))

import hetero_bench as hb  # noqa: E402


def test_the_cases_are_the_issues():
    assert {(c.model, c.cluster, c.global_batch) for c in hb.CASES} >= {
        ("vit22b-gpt175b", f"{n}xa100-80g", 1536) for n in (1536, 2048, 3072)}
    assert {c.model for c in hb.CASES} >= {"llava-1.5-7b", "vit22b-llama70b", "llava-1.5-13b", "mllama-11b-like"}
    assert hb.MODELS["mllama-11b-like"].decoder.cross_attention_every > 0
    assert all(c.vit22b == c.model.startswith("vit22b") for c in hb.CASES)


def test_a_row_has_both_baselines_speed_ups_and_the_mechanism(tmp_path):
    row = hb.run_case(hb.Case("tiny", "tiny-vlm", "4xlocal-cpu", 8), hb.profile_of("tiny-vlm", tmp_path), 30.0, "1f1b")
    assert (tmp_path / "tiny-vlm.json").exists()
    assert set(row["steps"]) == {"homogeneous", "megatron"}
    for name, step in row["steps"].items():
        assert step is not None and row["speedups"][name] >= 1.0 - 1e-9  # the solver never emits a slower plan
        assert row["why"][name]
    assert hb.target_text(1.25, 1.2) == "1.25x (>= 1.20 ok)" and hb.target_text(0.9, 1.0).endswith("MISS)")


def test_free_encoders_cost_nothing_and_bound_every_plan_of_the_real_model(tmp_path):
    """The --ceiling profile: the encoders' blocks keep their names and outputs but have no work, state or time, and
    its best plan is at least as fast as the real model's best (so the ratio bounds any encoder placement's gain)."""
    from cost_models.cluster_spec import parse_cluster
    from planner.solver.solve import solve

    prof = hb.profile_of("tiny-vlm", tmp_path)
    free = hb.free_encoders(prof)
    assert [b.name for b in free.blocks] == [b.name for b in prof.blocks]
    enc = [b for b in free.blocks if b.group != prof.blocks[-1].group]
    assert enc and all(b.params == 0 and b.fwd_flops == 0 and b.activation_bytes == 0 and b.fwd_ms is None for b in enc)
    assert all(a == b for a, b in zip(free.blocks, prof.blocks) if a.group == prof.blocks[-1].group)
    assert 0 < hb.encoder_share(prof) < 1 and hb.encoder_share(free) == 0
    cluster = parse_cluster("4xlocal-cpu")
    real, bound = (solve(p, cluster, 8, time_limit=30, baseline=False).step_time_s for p in (prof, free))
    assert bound < real

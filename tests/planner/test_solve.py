"""The solver: optimal on small random instances (against brute force), never worse than the best homogeneous
plan on the zoo, clear errors for impossible requests, anytime under a time limit."""
from __future__ import annotations

import itertools
import math
import random
from pathlib import Path

import pytest

from cost_models.cluster_spec import parse_cluster
from dataclasses import replace as _replace

from planner.solver.candidates import LOOKAHEADS, unit_layouts
from planner.solver.space import GPU_ONLY, Setting, divisors
from planner.solver.structure import profile_units
from planner.solver.search import build_layouts
from planner.solver.solve import VIRTUAL_STAGES, solve
from plans.cluster import Cluster, Device, Link
from plans.errors import MmplanError
from plans.graph import Block, Edge, Profile

# --- random small instances ------------------------------------------------------------------------------------


def random_instance(seed: int, *, max_gpus: int = 8) -> tuple[Profile, Cluster, int]:
    """Encoders (1 or 2) feeding an LLM, <= 16 blocks with random FLOPs, parameters, activations and outputs; a
    cluster of <= max_gpus ranks (one node, or two) whose device memory makes some layouts not fit."""
    rng = random.Random(seed)
    sources = rng.choice([1, 1, 2])
    sizes = [rng.randint(1, 4) for _ in range(sources)] + [rng.randint(2, 7)]
    blocks, edges = [], []
    for g, n in enumerate(sizes):
        group = "llm" if g == sources else f"enc{g}"
        tp = rng.random() < 0.5
        for i in range(n):
            flops = 10 ** rng.uniform(9, 12)
            params = int(10 ** rng.uniform(6, 8.5))
            act = 10 ** rng.uniform(5, 8)
            extra = {}
            if rng.random() < 0.5:  # split by op class, with an attention core and activations outside the TP regions
                attn = rng.uniform(0, 0.3) * flops
                extra = dict(fwd_matmul_flops=flops - attn, bwd_matmul_flops=2 * (flops - attn), fwd_attention_flops=attn,
                             bwd_attention_flops=2 * attn, fwd_memory_bytes=act * rng.uniform(1, 4),
                             bwd_memory_bytes=act * rng.uniform(1, 6), replicated_memory_fraction=rng.uniform(0, 0.5), matmuls=4,
                             activation_replicated_bytes=act * rng.uniform(0, 0.3), attention_core_bytes=act * rng.uniform(0, 0.6))
            blocks.append(Block(f"{group}.{i}", group, "Layer", params, 2 * params, flops, 2 * flops,
                                act, 10 ** rng.uniform(4, 7), supports_tp=tp, signature=f"{group}{i}", **extra))
            if i:
                edges.append(Edge(f"{group}.{i - 1}", f"{group}.{i}", blocks[-2].output_bytes))
    for g in range(sources):
        last = f"enc{g}.{sizes[g] - 1}"
        edges.append(Edge(last, "llm.0", next(b.output_bytes for b in blocks if b.name == last)))
    order = {b.name: i for i, b in enumerate(blocks)}
    edges.sort(key=lambda e: (order[e.src], order[e.dst]))
    b, e = tuple(blocks), tuple(edges)
    profile = Profile.build(f"random-{seed}", "bf16", 1, b, e)
    gpus = rng.choice([n for n in (2, 4, 8) if n <= max_gpus])
    per_node = rng.choice([gpus, max(1, gpus // 2)])
    state = sum(x.params for x in blocks) * 16
    device = Device("sim", {"bf16": 1e14}, int(state * rng.uniform(0.15, 1.2)) + 10**6, 1e12,
                    ((1e6, 0.05), (1e9, 0.4), (1e12, 0.7)))
    cluster = Cluster("sim", gpus // per_node, per_node, device, intra_node=Link(1e11, 2e-6), inter_node=Link(1e10, 1e-5),
                      host_to_device=Link(2e10, 1e-5), nvme=Link(8e9, 1e-4), host_memory_bytes=10**12, nvme_bytes=10**13)
    return profile, cluster, rng.choice([2, 4, 8])


STRUCTURES = {"auto": ("chain", "non-colocated", "colocated"), "non-colocated": ("non-colocated",), "colocated": ("colocated",)}


def brute_force(profile: Profile, cluster: Cluster, global_batch: int, schedule: str = "1f1b",
                placement: str = "auto") -> float | None:
    """The fastest fitting plan of the solver's one-count space (the branch and bound's: every group splits the step
    into the same number of micro-batches), by simulating every combination: every structure, number of
    micro-batches and candidate layout of every unit (cut points by the partition DP; tier policies keep / selective /
    recompute; sequence parallelism on and off at tp > 1; a source on its own ranks at every look-ahead; none pruned
    as dominated; colocated sources in the sink's bubbles or not), every GPU split."""
    setting = Setting(cluster, global_batch, "1f1b" if schedule == "interleaved" else schedule, "bf16", "adam", None, GPU_ONLY,
                      virtual_stages=VIRTUAL_STAGES if schedule == "interleaved" else ())
    n = cluster.world_size
    best = math.inf
    structures = [s for s in STRUCTURES[placement]
                  if profile_units(profile, s) is not None and (s != "non-colocated" or n >= len(profile_units(profile, s)))]
    for structure in structures or ["chain"]:  # the solver falls back to one layout for the whole model
        units = profile_units(profile, structure)
        sink = next((i for i, u in enumerate(units) if u.feeds), 0)
        for m in divisors(global_batch):
            if structure == "chain":
                options = [unit_layouts(units[0], setting, m, max_gpus=n, prune_dominated=False)]
            else:
                sink_layouts = unit_layouts(units[sink], setting, m, max_gpus=n - (len(units) - 1 if structure == "non-colocated" else 0),
                                            prune_dominated=False)
                depths = sorted({lay.pp for lay in sink_layouts})
                options = []
                for u, unit in enumerate(units):
                    if u == sink:
                        options.append(sink_layouts)
                    elif structure == "non-colocated":  # and every look-ahead k (Group.lookahead), as ahead_layouts sizes it
                        options.append([lay if not k else _replace(lay, lookahead=k, downstream=None if lay.downstream is None else lay.downstream - k)
                                        for k in LOOKAHEADS if not k or (setting.schedule == "1f1b" and k < m)
                                        for lay in unit_layouts(unit, setting, m, max_gpus=n - 1, downstream=[d + k for d in depths],
                                                                prune_dominated=False)])
                    else:
                        options.append(unit_layouts(unit, setting, m, max_gpus=n, downstream=depths, merge_depths=False, max_pp=1,
                                                    prune_dominated=False))
            for combo in itertools.product(*options):
                if structure == "non-colocated" and sum(lay.gpus for lay in combo) > n:
                    continue
                if structure == "colocated" and len({lay.gpus for lay in combo}) > 1:
                    continue
                if any(lay.downstream is not None and lay.downstream != combo[sink].pp for i, lay in enumerate(combo) if i != sink):
                    continue
                for fill in (False, True) if structure == "colocated" else (False,):  # sources in the sink's bubbles
                    plan = build_layouts(profile, cluster, global_batch, setting.schedule, structure, units, combo,
                                         fill_bubbles=fill)
                    if plan is not None and plan.predicted.fits:
                        best = min(best, plan.predicted.step_time_s)
    return None if best == math.inf else best


def check_optimal(seed: int, schedule: str = "1f1b", placement: str = "auto") -> None:
    profile, cluster, batch = random_instance(seed)
    units = len(profile_units(profile, "non-colocated") or ())
    if placement == "non-colocated" and cluster.world_size < units:
        return  # an error naming the missing GPUs: test_too_few_gpus_for_non_colocated_groups
    want = brute_force(profile, cluster, batch, schedule, placement)
    kwargs = dict(schedule=schedule, placement=placement, memory_tiers=False, baseline=False, memory_reserve=0.0)
    if want is None:
        with pytest.raises(MmplanError, match="in GPU memory"):
            solve(profile, cluster, batch, **kwargs)
        return
    got = solve(profile, cluster, batch, **kwargs)
    assert got.plan.predicted.fits
    if got.refinement is not None:
        # the brute force covers the one-count space (every group the plan's number of micro-batches); the per-group
        # refinement after the search (solve's step 4b) may only beat its optimum, and then the plan is not called
        # optimal. The search itself must still find that optimum exactly, and prove it.
        assert got.step_time_s < want and got.refinement.before_s >= want * (1 - 1e-9), (seed, got.plan.solver.notes)
        assert not got.proved_optimal and not got.plan.solver.optimal
        assert any(g.micro_batches is not None for g in got.plan.groups)
        got = solve(profile, cluster, batch, per_group_micro_batches=False, **kwargs)
    assert all(g.micro_batches is None for g in got.plan.groups)
    assert got.step_time_s == pytest.approx(want, rel=1e-9), (seed, got.structure, got.plan.solver.notes)
    assert got.proved_optimal and got.plan.solver.optimal


@pytest.mark.parametrize("seed", [0, 1, 2, 3, 5, 8, 10, 16])
def test_solver_matches_brute_force(seed):
    check_optimal(seed)


@pytest.mark.parametrize("seed", [0, 3, 7, 9, 13, 17])
def test_allocation_ilp_matches_brute_force_non_colocated(seed):
    check_optimal(seed, placement="non-colocated")


@pytest.mark.parametrize("seed", [1, 6, 10, 16])
def test_allocation_ilp_matches_brute_force_colocated(seed):
    check_optimal(seed, placement="colocated")


@pytest.mark.parametrize("seed", [4, 6])
def test_solver_matches_brute_force_gpipe(seed):
    check_optimal(seed, "gpipe")


@pytest.mark.parametrize("seed", [0, 2, 5, 11])
def test_solver_matches_brute_force_interleaved(seed):
    # --schedule interleaved: 1F1B layouts and interleaved 1F1B chain layouts (VIRTUAL_STAGES chunks per rank), in both
    check_optimal(seed, "interleaved")


@pytest.mark.slow
@pytest.mark.parametrize("placement", ["auto", "non-colocated", "colocated"])
@pytest.mark.parametrize("seed", range(20, 45))
def test_solver_matches_brute_force_more(seed, placement):
    check_optimal(seed, "1f1b" if seed % 3 else "gpipe", placement)


def test_every_candidate_bound_is_below_its_simulated_step():
    """The branch and bound is exact only if no bound exceeds the simulated step of its plan."""
    from planner.solver.allocate import combined_bound

    from dataclasses import replace

    for seed in range(10):
        profile, cluster, batch = random_instance(seed % 5, max_gpus=4)
        if seed >= 5:  # a frozen encoder: it runs forwards only and gets no gradient back
            profile = Profile.build(profile.model, "bf16", 1, tuple(replace(b, frozen=b.group == "enc0") for b in profile.blocks),
                                    profile.edges)
        setting = Setting(cluster, batch, "1f1b" if seed % 2 else "gpipe", "bf16")
        rng = random.Random(seed)
        for structure in ("chain", "non-colocated", "colocated"):
            units = profile_units(profile, structure)
            if units is None:
                continue
            for m in divisors(batch):
                per_unit = [unit_layouts(u, setting, m, max_gpus=cluster.world_size, max_pp=1 if structure == "colocated" and u.out_bytes else None)
                            for u in units]
                for _ in range(10):
                    combo = tuple(rng.choice(c) for c in per_unit if c) if all(per_unit) else ()
                    if not combo:
                        break
                    plan = build_layouts(profile, cluster, batch, setting.schedule, structure, units, combo)
                    if plan is None or (structure == "colocated" and len({lay.gpus for lay in combo}) > 1):
                        continue
                    if structure == "non-colocated" and sum(lay.gpus for lay in combo) > cluster.world_size:
                        continue
                    assert combined_bound(units, combo, structure, cluster) <= plan.predicted.step_time_s * (1 + 1e-9)


# --- never worse than the best homogeneous plan on the zoo ---------------------------------------------------


@pytest.fixture(scope="session")
def zoo_profiles():
    """Profiles of every zoo model, built once per test session (real-size ones take a few seconds each)."""
    from planner.profiler.profile import profile_model
    from runtime.models import zoo
    from runtime.source import resolve

    cache: dict[str, Profile] = {}

    def get(name: str) -> Profile:
        if name not in cache:
            cache[name] = profile_model(resolve(name))
        return cache[name]

    get.names = zoo.names()
    return get


def check_never_worse(profile: Profile, gpus: int) -> None:
    cluster = parse_cluster(f"{gpus}xh100-sxm")
    got = solve(profile, cluster, 2 * gpus)
    assert got.plan.predicted.fits
    base = got.baseline
    if base is None:
        # planner/solver/baselines.py finds no homogeneous plan of a model with a batch-reducing block (a contrastive
        # head needs dp = 1; its grid search raises on dp > 1): nothing to compare with
        assert any(b.reduces_batch for b in profile.blocks)
        return
    if base.predicted.fits:
        assert got.step_time_s <= base.predicted.step_time_s * (1 + 1e-12)
        assert got.speedup >= 1 - 1e-12
    if got.megatron is not None and got.megatron.predicted.fits:
        assert got.step_time_s <= got.megatron.predicted.step_time_s * (1 + 1e-12)
    if got.structure == "baseline":
        assert got.plan.solver.method in ("baseline:homogeneous", "baseline:megatron") and "emitted" in got.plan.solver.notes


TINY = ["tiny-vlm", "tiny-vlm-tied", "tiny-avlm", "tiny-flamingo", "tiny-clip", "tiny-vlm-heavy"]


# 512 GPUs and tiny-avlm at 64 take 4-10 s each: in the slow set (python -m pytest -m slow tests/planner/test_solve.py)
@pytest.mark.parametrize(("model", "gpus"), [
    pytest.param(model, gpus, marks=pytest.mark.slow, id=f"{model}-{gpus}") if gpus == 512 or (model, gpus) == ("tiny-avlm", 64)
    else pytest.param(model, gpus, id=f"{model}-{gpus}") for gpus in (8, 64, 512) for model in TINY])
def test_never_worse_than_homogeneous_tiny(zoo_profiles, model, gpus):
    check_never_worse(zoo_profiles(model), gpus)


@pytest.mark.parametrize("model,gpus", [("llava-1.5-7b", 64), pytest.param("whisper-llama-7b", 8, marks=pytest.mark.slow)])
def test_never_worse_than_homogeneous_real(zoo_profiles, model, gpus):
    check_never_worse(zoo_profiles(model), gpus)


@pytest.mark.slow
@pytest.mark.parametrize("gpus", [8, 64, 512])
@pytest.mark.parametrize("model", ["llava-1.5-7b", "llava-1.5-13b", "qwen2-vl-72b", "vit22b-llama70b", "whisper-llama-7b"])
def test_never_worse_than_homogeneous_every_real_model(zoo_profiles, model, gpus):
    check_never_worse(zoo_profiles(model), gpus)


def test_every_zoo_model_is_covered(zoo_profiles):
    slow = {"llava-1.5-7b", "llava-1.5-13b", "qwen2-vl-72b", "vit22b-llama70b", "whisper-llama-7b"}
    assert set(zoo_profiles.names) == set(TINY) | slow


# --- what the solver emits ---------------------------------------------------------------------------------------


@pytest.mark.slow  # 23 s (vit22b-llama70b on 128 GPUs): python -m pytest -m slow tests/planner/test_solve.py
def test_heterogeneous_layouts_and_modality_aware_gpus(zoo_profiles):
    """On an encoder-heavy model in the pipeline regime the best plan gives the encoder its own layout and a
    GPU share near its FLOP share."""
    profile = zoo_profiles("vit22b-llama70b")
    # baseline=False: with ZeRO 0-3 searched, one unpipelined ZeRO layout for the whole model is faster here
    # (and would be emitted); this test is about the non-colocated structure's own allocation
    got = solve(profile, parse_cluster("128xh100-sxm"), 128, placement="non-colocated", baseline=False)
    vision, llm = got.plan.groups
    assert (vision.name, llm.name) == ("vision", "llm") and vision.colocated_with is None
    assert "vision_proj" in vision.blocks  # the projector joins the encoder it follows
    share = len(vision.ranks) / (len(vision.ranks) + len(llm.ranks))
    flops = {b.name: b.fwd_flops + b.bwd_flops for b in profile.blocks}
    flop_share = sum(flops[b] for b in vision.blocks) / sum(flops.values())
    assert flop_share / 4 < share < flop_share * 4
    assert (vision.tp, vision.dp, vision.pp) != (llm.tp, llm.dp, llm.pp)


def test_local_cpu_plans_keep_tp_1_and_the_schedule(zoo_profiles):
    cluster = parse_cluster("4xlocal-cpu")
    for schedule in ("gpipe", "1f1b"):
        got = solve(zoo_profiles("tiny-avlm"), cluster, 8, schedule=schedule)
        assert got.plan.training.schedule == schedule and got.plan.training.virtual_stages == 1
        assert all(g.tp == 1 for g in got.plan.groups)
        assert got.plan.world_size <= 4


def test_colocated_placement_shares_ranks(zoo_profiles):
    got = solve(zoo_profiles("tiny-avlm"), parse_cluster("2xlocal-cpu"), 16, placement="colocated", baseline=False)
    groups = {g.name: g for g in got.plan.groups}
    assert set(groups) == {"vision", "audio", "llm"}
    assert groups["vision"].colocated_with == "llm" and set(groups["vision"].ranks) == set(groups["llm"].ranks)
    assert got.plan.solver.method == "ilp+dp:colocated"


def test_the_search_includes_every_zero_stage(zoo_profiles):
    from planner.solver.candidates import ZERO_STAGES, zero_stages

    assert ZERO_STAGES == (0, 1, 2, 3) and zero_stages(parse_cluster("8xh100-sxm"), 4) == ZERO_STAGES
    assert zero_stages(parse_cluster("8xh100-sxm"), 1) == (0,)


def test_memory_reserve_leaves_that_share_of_every_gpu_free(zoo_profiles):
    profile, cluster = zoo_profiles("llava-1.5-7b"), parse_cluster("8xh100-sxm")
    free = solve(profile, cluster, 16, memory_reserve=0.0)
    tight = solve(profile, cluster, 16, memory_reserve=0.5)
    cap = cluster.device.memory_bytes
    assert tight.plan.cluster == cluster and tight.plan.solver.memory_reserve == 0.5
    assert max(m.gpu for m in tight.plan.predicted.memory) <= 0.5 * cap
    assert free.step_time_s <= tight.step_time_s * (1 + 1e-12)  # a larger reserve can only slow the plan
    for b in tight.baselines.values():
        assert max(m.gpu for m in b.predicted.memory) <= 0.5 * cap


# --- more device memory never slows the plan ---------------------------------------------------------------------

MONOTONE = Path(__file__).resolve().parents[1] / "fixtures" / "solve_monotone"


# Issue 11's case: at 0.13 GB the search used to find only GPU-only plans slower than the 0.1 GB offloading one (0.5348 s
# vs 0.4181 s). Colocated sources now also get their leaner policies (candidates.colocated_layouts: a source sharing the
# sink's ranks may need to recompute to leave the sink room), and the 0.13 GB search finds a faster colocated plan.
# Tier policies are still searched only when no GPU-only plan fits; this case no longer shows that gap.
def test_more_device_memory_never_gives_a_slower_plan():
    # a measured CPU profile of a conv-encoder VLM on a calibrated 2-rank gloo cluster (the demo's, capped): at 100 MB
    # per rank nothing fits GPU-only and the tier search finds 1 micro-batch with gradients / optimizer state offloaded
    # (0.418 s); at 130 MB GPU-only plans fit (8 micro-batches, 0.535 s) and the search used to stop there, never
    # trying the tiers that are faster (planner/solver/solve.py _search)
    from dataclasses import replace

    from cost_models.evaluate import evaluate
    from cost_models.cluster_toml import load_cluster_toml
    from plans.graph import load_profile

    profile = load_profile(MONOTONE / "conv64.json")
    small = load_cluster_toml(MONOTONE / "cap0.1.toml")
    large = replace(small, device=replace(small.device, memory_bytes=int(0.13e9)))
    tight, roomy = solve(profile, small, 8), solve(profile, large, 8)
    assert tight.proved_optimal and roomy.proved_optimal
    # the 100 MB plan fits the 130 MB cluster (with its reserve) and takes the same time there
    there = evaluate(tight.plan, profile, replace(large, device=replace(large.device, memory_bytes=int(0.13e9 * 0.9))))
    assert there.predicted.fits and there.predicted.step_time_s == pytest.approx(tight.step_time_s, rel=1e-12)
    assert roomy.step_time_s <= tight.step_time_s * (1 + 1e-9), (tight.step_time_s, roomy.step_time_s)


# Random small instances, memory tiers on, solved at device memory x1 and x1.3. Seeds 46 and 61 failed while ZeRO 1-2's
# parameter gather was priced after the optimizer step (46: the partition DP, minimising the slowest stage, picked cut
# points whose simulated step was 1 % slower with more room; 61: per-block tiers (tiers.py) refine only the search's
# best plan, and the plan refining best at the smaller cap was not the one refined at the larger). Both causes remain
# possible in the solver's heuristic space; with the gather priced where FSDP2 runs it, these seeds no longer show them.
@pytest.mark.parametrize("seed", [6, 7, 13, 16, 22, 46, 61])
def test_more_device_memory_never_slows_random_instances(seed):
    from dataclasses import replace

    profile, cluster, batch = random_instance(seed, max_gpus=4)
    host = int(cluster.device.memory_bytes * random.Random(seed).uniform(0.2, 2))  # host memory and NVMe that bind too
    cluster = replace(cluster, host_memory_bytes=host, nvme_bytes=4 * host)
    steps = []
    for scale in (1.0, 1.3):
        c = replace(cluster, device=replace(cluster.device, memory_bytes=int(cluster.device.memory_bytes * scale)))
        steps.append(solve(profile, c, batch, memory_reserve=0.0, baseline=False).step_time_s)
    assert steps[1] <= steps[0] * (1 + 1e-9), steps

def test_time_limit_counts_from_the_given_start(zoo_profiles):
    import time

    profile, cluster = zoo_profiles("tiny-avlm"), parse_cluster("4xlocal-cpu")
    got = solve(profile, cluster, 8, time_limit=1.0, started=time.perf_counter() - 5.0)  # already spent before solving
    # only the quick unpipelined incumbent (simulated even past the limit) is returned
    assert got.stopped_early and got.plan.predicted.fits and got.structure in ("chain", "baseline")
    assert got.plan.groups[0].pp == 1 and got.simulated <= 4 and not got.plan.solver.optimal


def test_time_limit_returns_the_best_so_far(zoo_profiles):
    # 2 s: with TP activations stored as the runtime stores them (no sequence parallelism, issue 11) fewer layouts
    # fit, and the search needs ~1-2 s to reach its first fitting plan (0.5 s sufficed before)
    got = solve(zoo_profiles("vit22b-llama70b"), parse_cluster("512xh100-sxm"), 1024, time_limit=2.0, baseline=False)
    assert got.stopped_early and got.plan.solver.stopped_early and got.plan.predicted.fits
    assert "time limit" in got.plan.solver.notes


# --- impossible requests -----------------------------------------------------------------------------------------


def test_cannot_fit_even_with_every_tier_names_the_bytes(zoo_profiles):
    cluster = parse_cluster("local-cpu")  # 2 ranks, ~25 GB RAM and 50 GB disk in all
    with pytest.raises(MmplanError, match=r"[KMGT]?B short"):
        solve(zoo_profiles("vit22b-llama70b"), cluster, 2)


def test_without_tiers_the_error_names_the_gpu_shortfall(zoo_profiles):
    with pytest.raises(MmplanError, match=r"does not fit on 2 x h100-sxm in GPU memory .* GB short"):
        solve(zoo_profiles("vit22b-llama70b"), parse_cluster("2xh100-sxm"), 2, memory_tiers=False)


@pytest.mark.parametrize("memory,advice", [(10_000, "more GPUs do not help: one block per stage still needs"),
                                           (495_000, "add GPUs")])
def test_the_no_fit_advice_says_add_gpus_only_when_more_would_fit(zoo_profiles, memory, advice):
    """Issue 15/30's misleading "add GPUs": on 4 ranks tiny-vlm's least-loaded layout needs ~507 kB per GPU and ~479 kB
    with one of its 10 blocks per stage; more GPUs help only when the GPU holds the latter."""
    from planner.profiler.profile import profile_model
    from runtime.source import resolve

    cluster = parse_cluster("4xlocal-cpu")
    cluster = _replace(cluster, device=_replace(cluster.device, memory_bytes=memory))
    with pytest.raises(MmplanError, match="short") as err:
        solve(profile_model(resolve("tiny-vlm")), cluster, 8, memory_reserve=0.0, time_limit=60)
    assert advice in str(err.value) and ("add GPUs" in str(err.value)) == (advice == "add GPUs"), str(err.value)


def test_too_few_gpus_for_non_colocated_groups(zoo_profiles):
    with pytest.raises(MmplanError, match=r"needs at least 3 GPUs; the cluster has 2 \(1 short\)"):
        solve(zoo_profiles("tiny-avlm"), parse_cluster("2xlocal-cpu"), 4, placement="non-colocated")


@pytest.mark.parametrize("kwargs,match", [
    (dict(micro_batch=3), "does not divide the global batch"),
    (dict(schedule="zigzag"), "gpipe, 1f1b, interleaved"),
    (dict(placement="sideways"), "--placement"),
    (dict(time_limit=0), "--time-limit"),
])
def test_bad_options(zoo_profiles, kwargs, match):
    with pytest.raises(MmplanError, match=match):
        solve(zoo_profiles("tiny-vlm"), parse_cluster("2xlocal-cpu"), 4, **kwargs)


def test_global_batch_must_be_positive(zoo_profiles):
    with pytest.raises(MmplanError, match="positive integer"):
        solve(zoo_profiles("tiny-vlm"), parse_cluster("2xlocal-cpu"), 0)


def test_the_interleaved_grid_holds_interleaved_1f1b_where_it_is_faster(zoo_profiles):
    # llava-1.5-13b on 16 H100 at a small global batch, pipelined 4 ways: few micro-batches per pipeline, so the
    # bubble decides and interleaving (v chunks per rank) shrinks it by v (Narayanan et al. 2021, section 2.2). The
    # layout is fixed: over all layouts plain data parallelism wins here (dp 16 crosses nodes at 8 NICs per node,
    # comm.collective_link), and it has no bubble to shrink
    from planner.solver import baselines

    prof, cluster = zoo_profiles("llava-1.5-13b"), parse_cluster("16xh100-sxm")
    layout = "tp=2,pp=4,dp=2"
    best = baselines.best_megatron(prof, cluster, 32, schedules=("1f1b", "interleaved:2", "interleaved:4"), layout=layout)
    plain = baselines.best_megatron(prof, cluster, 32, schedules=("1f1b",), layout=layout)
    assert best.training.schedule == "interleaved" and best.training.virtual_stages >= 2
    assert best.predicted.step_time_s < plain.predicted.step_time_s and plain.training.schedule == "1f1b"


def test_solve_with_the_interleaved_schedule_emits_the_faster_plan(zoo_profiles):
    cluster = parse_cluster("4xlocal-cpu")
    got = solve(zoo_profiles("tiny-vlm"), cluster, 8, schedule="interleaved")
    plain = solve(zoo_profiles("tiny-vlm"), cluster, 8)
    assert got.step_time_s <= plain.step_time_s * (1 + 1e-9)
    assert got.plan.training.schedule in ("1f1b", "interleaved")


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_no_pipelined_layout_bound_exceeds_its_simulated_step(schedule):
    """The layout bound (planner/solver/bounds.py, with its combined warm-up + cool-down term) on many pipelined chain
    layouts of random instances: never above the simulated step."""
    checked, tight = 0, 0
    for seed in range(40):
        profile, cluster, batch = random_instance(100 + seed, max_gpus=8)
        if seed % 3 == 0:  # a frozen encoder: its stages run forwards only
            from dataclasses import replace

            blocks = tuple(replace(b, frozen=b.group == "enc0") for b in profile.blocks)
            profile = Profile.build(profile.model, "bf16", 1, blocks, profile.edges)
        setting = Setting(cluster, batch, schedule, "bf16")
        units = profile_units(profile, "chain")
        rng = random.Random(seed)
        for m in divisors(batch):
            lays = [lay for lay in unit_layouts(units[0], setting, m, max_gpus=cluster.world_size, prune_dominated=False) if lay.pp > 1]
            for lay in rng.sample(lays, min(4, len(lays))):
                plan = build_layouts(profile, cluster, batch, schedule, "chain", units, (lay,))
                if plan is None:
                    continue
                step = plan.predicted.step_time_s
                assert lay.bound.own <= step * (1 + 1e-9), (seed, m, lay.tp, lay.dp, lay.pp, lay.bound.own, step)
                checked += 1
                tight += lay.bound.own >= step * 0.99
    assert checked >= 200
    assert tight >= checked // 2  # most bounds are within 1 % of the step (the combined term)


def test_interleaved_layout_bound_never_exceeds_its_simulated_step():
    """planner/solver/bounds.py's interleaved bound on every interleaved chain layout of random instances."""
    checked = 0
    for seed in range(30):
        profile, cluster, batch = random_instance(300 + seed, max_gpus=8)
        setting = Setting(cluster, batch, "1f1b", "bf16", virtual_stages=(2, 4))
        units = profile_units(profile, "chain")
        for m in divisors(batch):
            for lay in unit_layouts(units[0], setting, m, max_gpus=cluster.world_size, prune_dominated=False):
                if lay.chunks == 1:
                    continue
                plan = build_layouts(profile, cluster, batch, "1f1b", "chain", units, (lay,))
                assert plan is not None and plan.training.schedule == "interleaved" and plan.training.virtual_stages == lay.chunks
                assert [len(s.blocks) for s in plan.groups[0].stages] == [len(b) for b in lay.stage_blocks([b.name for b in profile.blocks])]
                assert lay.bound.own <= plan.predicted.step_time_s * (1 + 1e-9), (seed, m, lay.pp, lay.chunks)
                checked += 1
    assert checked >= 50


def test_sequence_parallelism_is_searched_where_tp_does_not_divide_the_sequence():
    # a 17-token encoder (a ViT's class token) is sequence-parallel over 2 ranks padded to 18 (runtime/sequence_parallel.py),
    # a 32-token LLM without padding: the solver searches both
    from dataclasses import replace

    from planner.solver.candidates import sp_divides, sp_values
    from planner.solver.segments import BlockTimes

    profile, cluster, batch = next((p, c, b) for p, c, b in map(random_instance, range(50))
                                   if len(profile_units(p, "non-colocated") or ()) == 2)
    blocks = tuple(replace(b, supports_tp=True, sequence=17 if b.group != "llm" else 32) for b in profile.blocks)
    profile = Profile.build(profile.model, "bf16", 1, blocks, profile.edges)
    enc, llm = profile_units(profile, "non-colocated")
    setting = Setting(cluster, batch, "1f1b", "bf16")
    times = BlockTimes(setting)
    assert sp_divides(enc.blocks, 2) and sp_divides(llm.blocks, 2) and sp_divides(llm.blocks, 4)
    assert sp_values(enc, setting, 2, 1.0, times, prune=False) == (False, True)
    assert sp_values(llm, setting, 2, 1.0, times, prune=False) == (False, True)
    assert any(lay.sequence_parallel and lay.tp > 1 for m in divisors(batch)
               for lay in unit_layouts(enc, setting, m, max_gpus=cluster.world_size, prune_dominated=False))


def test_no_memory_tiers_holds_for_the_homogeneous_baseline_too(zoo_profiles):
    """--no-memory-tiers: no state or activation leaves the GPU in the written plan, whichever plan wins. The
    homogeneous baseline's tiers were refined regardless, and on Qwen2-VL-72B it won with 47 blocks' activations on
    the CPU."""
    solution = solve(zoo_profiles("qwen2-vl-72b"), parse_cluster("16xa100-80g"), 16, memory_tiers=False)
    for plan in (solution.plan, solution.baseline):
        for group in plan.groups:
            for stage in group.stages:
                m = stage.memory
                assert (m.params, m.grads, m.optimizer) == ("gpu", "gpu", "gpu")
                assert set(m.activations.values()) <= {"recompute", "selective"}, m.activations


def test_a_time_limit_leaves_the_megatron_baseline_its_share():
    """The chain structure is held to CHAIN_SHARE of --time-limit, so the Megatron-style baseline is still searched
    (at 1,536 A100s a 60 s limit used to go to the chain alone, and the plan came out 0.95x of Megatron's)."""
    from planner.profiler.profile import profile_model
    from planner.solver.search import Search
    from planner.solver.solve import CHAIN_SHARE, _end_phase
    from runtime.source import resolve

    search = Search(None, None, 8, "1f1b", deadline=110.0, progress=lambda *a: None, started=10.0)
    search.resume_deadline, search.deadline, search.stopped_early = 110.0, 10.0 + CHAIN_SHARE * 100.0, True
    assert _end_phase(search) is search and (search.deadline, search.resume_deadline) == (110.0, None)
    assert search.phase_stopped and not search.stopped_early
    profile = profile_model(resolve("tiny-vlm"))
    solution = solve(profile, parse_cluster("4xlocal-cpu"), 8, time_limit=30)
    assert solution.megatron is not None and solution.step_time_s <= solution.megatron.predicted.step_time_s * (1 + 1e-9)


def test_a_time_limit_is_kept_when_writing_the_plan_is_slow(monkeypatch, tmp_path, zoo_profiles):
    """A loaded machine as a fake clock (issue 30: --time-limit 20 at 8,192 GPUs took 33 s): each plan simulated costs
    0.5 s and each check of a plan (most of writing it) 6 s of it; solving and writing end within 10 % of the limit
    because the reserve is measured on the quick incumbent, not estimated."""
    import time

    import plans.plan as plan_module
    from planner.solver.search import Search
    from planner.solver.solve import run_solve
    from plans.graph import save_profile

    real, spent = time.perf_counter, [0.0]
    monkeypatch.setattr(time, "perf_counter", lambda: real() + spent[0])
    check, simulate = plan_module.check_plan, Search.simulate

    def slow_check(*args, **kwargs):
        spent[0] += 6.0
        return check(*args, **kwargs)

    def slow_simulate(self, *args, **kwargs):
        spent[0] += 0.5
        return simulate(self, *args, **kwargs)

    monkeypatch.setattr(plan_module, "check_plan", slow_check)
    monkeypatch.setattr(Search, "simulate", slow_simulate)
    save_profile(zoo_profiles("tiny-avlm"), tmp_path / "profile.json")
    started = time.perf_counter()
    solution, _ = run_solve(profile_path=tmp_path / "profile.json", cluster="64xh100-sxm", global_batch=64,
                            output=tmp_path / "plan.json", time_limit=30.0, started=started)
    assert solution.stopped_early and (tmp_path / "plan.json").exists()
    assert time.perf_counter() - started <= 30.0 * 1.1

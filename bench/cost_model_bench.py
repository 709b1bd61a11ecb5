"""Times one cost-model evaluation of realistic multimodal plans on 128 and 1024 H100s (target 50 ms), and the
search of the homogeneous (Megatron-style) grid for the best baseline (target 10 s at 1024 GPUs).

Run: python bench/cost_model_bench.py [--profiles DIR]  (DIR/<model>.json written by `mmplan profile <model> -o ...`
is used when present; otherwise a synthetic profile of the same shape is built here).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cost_models.evaluate import evaluate  # noqa: E402
from cost_models.cluster_spec import catalog_cluster  # noqa: E402
from planner.solver.baselines import best_homogeneous  # noqa: E402
from plans import plan as P  # noqa: E402
from plans.graph import Block, Edge, InputEdge, Profile, load_profile  # noqa: E402

TARGET_S = 0.050  # one evaluation of a 1024-GPU plan
GRID_TARGET_S = 10.0  # searching the homogeneous grid at 1024 GPUs (planner/solver/baselines.py best_homogeneous)
# Homogeneous grid search: model -> (cluster, global batch); 4 samples per GPU.
GRID = {"vit22b-llama70b": ("128xh100-sxm", 512), "qwen2-vl-72b": ("1024xh100-sxm", 4096)}
# The default grid (1f1b; recompute none | full; ZeRO 0 | 1) and a wide one (every schedule and option).
GRID_OPTIONS = {"default": {}, "wide": {"schedules": ("1f1b", "gpipe", "interleaved:2"),
                                        "recomputes": ("none", "selective", "full"), "zeros": (0, 1, 2, 3)}}
BF16 = 2  # bytes


def layer(name: str, group: str, *, hidden: int, mlp: int, seq: int, heads: int, kv_heads: int, gated: bool) -> Block:
    """A pre-norm transformer layer, per sample. FLOPs: 2 x linear params x tokens + 4 s^2 h for QK^T and AV
    (Narayanan et al. 2021, appendix; full S^2, as the profiler counts it). Saved activations: 34 s h bytes
    (Korthikanti et al. 2022, eq. 1, with flash attention dropping the 5 a s^2 b term)."""
    kv = hidden * kv_heads // heads
    params = 2 * hidden * hidden + 2 * hidden * kv + (3 if gated else 2) * hidden * mlp
    fwd = 2 * params * seq + 4 * seq * seq * hidden
    return Block(name, group, "Layer", params, BF16 * params, float(fwd), float(2 * fwd), 34.0 * seq * hidden,
                 float(BF16 * seq * hidden), supports_tp=True, signature=f"{group}-layer")


def linear(name: str, group: str, n_in: int, n_out: int, tokens: int, *, out_bytes: float | None = None) -> Block:
    """A dense projection over `tokens` tokens (2 FLOPs per weight and token forward, 4 backward)."""
    params = n_in * n_out
    return Block(name, group, "Linear", params, BF16 * params, 2.0 * params * tokens, 4.0 * params * tokens,
                 float(BF16 * tokens * n_in), out_bytes if out_bytes is not None else float(BF16 * tokens * n_out),
                 signature=f"{name}-{n_in}x{n_out}")


def synthetic_profile(model: str) -> Profile:
    """A profile of the zoo model's shape (runtime/models/zoo.py), its blocks named as the profiler names them."""
    if model == "vit22b-llama70b":
        vit = dict(hidden=6144, mlp=24576, seq=256, heads=48, kv_heads=48, layers=48, patch=14, merge=1)
        llm = dict(hidden=8192, mlp=28672, heads=64, kv_heads=8, layers=80, vocab=32000, text=2048 - 256)
    elif model == "qwen2-vl-72b":
        vit = dict(hidden=1280, mlp=5120, seq=1024, heads=16, kv_heads=16, layers=32, patch=14, merge=4)
        llm = dict(hidden=8192, mlp=29568, heads=64, kv_heads=8, layers=80, vocab=152064, text=2048 - 256)
    else:
        raise SystemExit(f"no synthetic shape for {model!r}; use vit22b-llama70b or qwen2-vl-72b")
    image_tokens = vit["seq"] // vit["merge"]
    seq = image_tokens + llm["text"]  # prefix model: image tokens then text through the decoder
    shape = {k: vit[k] for k in ("hidden", "mlp", "seq", "heads", "kv_heads")}
    blocks = [linear("vision.patch_embed", "vision", 3 * vit["patch"] ** 2, vit["hidden"], vit["seq"])]
    blocks += [layer(f"vision.layers.{i}", "vision", **shape, gated=False) for i in range(vit["layers"])]
    blocks += [linear("vision_proj", "vision_proj", vit["hidden"] * vit["merge"], llm["hidden"], image_tokens)]
    blocks += [linear("llm.embed", "llm", llm["vocab"], llm["hidden"], 0, out_bytes=float(BF16 * llm["text"] * llm["hidden"]))]
    shape = dict(hidden=llm["hidden"], mlp=llm["mlp"], seq=seq, heads=llm["heads"], kv_heads=llm["kv_heads"])
    blocks += [layer(f"llm.layers.{i}", "llm", **shape, gated=True) for i in range(llm["layers"])]
    blocks += [linear("llm.head", "llm", llm["hidden"], llm["vocab"], seq)]
    out = {b.name: b.output_bytes for b in blocks}
    names = [b.name for b in blocks]
    edges = [Edge(a, b, out[a]) for a, b in zip(names, names[1:]) if a != "vision_proj" and b != "llm.embed"]
    edges.append(Edge("vision_proj", "llm.layers.0", out["vision_proj"]))
    inputs = (InputEdge("images", "vision.patch_embed", float(BF16 * 3 * vit["patch"] ** 2 * vit["seq"])),
              InputEdge("tokens", "llm.embed", 8.0 * llm["text"]))  # int64 token ids
    b, e = tuple(blocks), tuple(sorted(edges, key=lambda x: names.index(x.src)))
    return Profile.build(model, "bf16", 1, b, e, inputs)


def split(blocks: list[Block], parts: int) -> list[list[str]]:
    """Contiguous parts of about equal forward FLOPs (greedy on the prefix sum), none empty."""
    total = sum(b.fwd_flops for b in blocks)
    out: list[list[str]] = [[] for _ in range(parts)]
    acc = 0.0
    for i, b in enumerate(blocks):
        k = max(min(parts - 1, int(acc / total * parts)), parts - (len(blocks) - i))
        out[k].append(b.name)
        acc += b.fwd_flops
    return out


def group(profile: Profile, name: str, *, dp: int, tp: int, pp: int, first: int, v: int = 1, zero: int = 0,
          colocated_with: str | None = None, recompute: bool = False) -> P.Group:
    """Stage i holds chunks i, i+pp, ... of the group's pp*v balanced chunks; ranks tp fastest, then dp, then pp.
    recompute: full activation recomputation of the transformer layers (Megatron's --recompute-granularity full)."""
    chunks = split(list(profile.group_blocks(name)), pp * v)
    n = dp * tp
    stages = []
    for i in range(pp):
        names = tuple(b for k in range(i, pp * v, pp) for b in chunks[k])
        tiers = {b: "recompute" for b in names if ".layers." in b} if recompute else {}
        stages.append(P.Stage(names, tuple(range(first + i * n, first + (i + 1) * n)), P.Memory(activations=tiers)))
    return P.Group(name, dp, tp, pp, tuple(stages), zero=zero, colocated_with=colocated_with)


def plans(profile: Profile) -> list[tuple[str, Profile, P.Plan]]:
    """Hand-made layouts of the kind the solver proposes, with the (possibly regrouped) profile they are for."""
    def plan(prof: Profile, cluster, training: P.Training, groups: tuple[P.Group, ...]) -> P.Plan:
        built = P.Plan(P.ProfileRef(prof.model, prof.fingerprint), cluster, training, groups)
        return P.check_plan(built, prof)  # validates and fills the flow once, outside the timing

    if profile.model == "vit22b-llama70b":
        cluster = catalog_cluster("128xh100-sxm")
        non_colocated = (
            group(profile, "vision", dp=2, tp=8, pp=2, first=0, zero=1),
            group(profile, "vision_proj", dp=4, tp=8, pp=1, first=0, colocated_with="vision"),
            group(profile, "llm", dp=3, tp=8, pp=4, first=32, zero=1),
        )
        return [("non-colocated vision 32 / llm 96, 1f1b", profile, plan(profile, cluster, P.Training(96, 8), non_colocated))]
    cluster = catalog_cluster("1024xh100-sxm")
    # LLM layers recompute their activations (at 8-16 samples per replica and micro-batch they would not fit).
    # plans/plan.py asks every stage of every group for >= virtual_stages blocks: the one-block projector
    # joins the vision group for the interleaved plan.
    merged = profile.with_groups({"vision_proj": "vision"})
    colocated = (
        group(merged, "vision", dp=128, tp=8, pp=1, first=0, zero=1, colocated_with="llm"),
        group(merged, "llm", dp=16, tp=8, pp=8, first=0, v=2, zero=1, recompute=True),
    )
    non_colocated = (
        group(profile, "vision", dp=16, tp=4, pp=1, first=0, zero=1),
        group(profile, "vision_proj", dp=16, tp=4, pp=1, first=0, colocated_with="vision"),
        group(profile, "llm", dp=15, tp=8, pp=8, first=64, zero=1, recompute=True),
    )
    return [
        ("colocated, llm tp8 pp8 dp16 interleaved v2", merged,
         plan(merged, cluster, P.Training(4096, 32, "interleaved", 2), colocated)),
        ("non-colocated vision 64 / llm 960, 1f1b", profile, plan(profile, cluster, P.Training(7680, 32), non_colocated)),
    ]


def median_s(plan: P.Plan, profile: Profile, repeats: int = 20) -> tuple[float, float]:
    """Median wall time and median CPU time of one evaluate() call (CPU time is what a loaded, shared
    machine does not inflate)."""
    wall, cpu = [], []
    for _ in range(repeats):
        t, c = time.perf_counter(), time.process_time()
        evaluate(plan, profile)
        wall.append(time.perf_counter() - t)
        cpu.append(time.process_time() - c)
    return statistics.median(wall), statistics.median(cpu)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profiles", type=Path, help="directory of <model>.json profiles written by `mmplan profile`")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args(argv)
    print(f"{'model':<16} {'profile':<9} {'GPUs':>5} {'layout':<43} {'eval ms':>8} {'cpu ms':>7} {'target':>7} {'step s':>7} "
          f"{'MFU':>6} {'bubble':>6} fits")
    for model in ("vit22b-llama70b", "qwen2-vl-72b"):
        path = args.profiles / f"{model}.json" if args.profiles else None
        real = path is not None and path.exists()
        profile = load_profile(path) if real else synthetic_profile(model)
        for name, planned, plan in plans(profile):
            wall, cpu = median_s(plan, planned, args.repeats)
            p = evaluate(plan, planned).predicted
            target = f"<= {TARGET_S * 1e3:.0f}" if plan.world_size >= 1024 else "-"
            print(f"{model:<16} {'profiled' if real else 'synthetic':<9} {plan.world_size:>5} {name:<43} {wall * 1e3:>8.1f} {cpu * 1e3:>7.1f} "
                  f"{target:>7} {p.step_time_s:>7.2f} {p.mfu:>6.1%} {p.bubble_fraction:>6.1%} {'yes' if p.fits else 'no'}")
    print()
    print(f"{'model':<16} {'GPUs':>5} {'batch':>6} {'grid':<8} {'layouts':>7} {'fit':>5} {'simulated':>9} {'search s':>8} "
          f"{'cpu s':>6} {'target':>7}  best layout (step s, MFU)")
    for model, (cluster_name, batch) in GRID.items():
        path = args.profiles / f"{model}.json" if args.profiles else None
        profile = load_profile(path) if path is not None and path.exists() else synthetic_profile(model)
        cluster = catalog_cluster(cluster_name)
        for grid, options in GRID_OPTIONS.items():
            t, c = time.perf_counter(), time.process_time()
            best = best_homogeneous(profile, cluster, batch, **options)
            wall, cpu = time.perf_counter() - t, time.process_time() - c
            layout, counts = best.solver.notes.split("; ", 1)
            fit, simulated = counts.split(", ")[1].split()[0], counts.split(", ")[2].split()[0]
            target = f"<= {GRID_TARGET_S:.0f}" if cluster.world_size >= 1024 else "-"
            print(f"{model:<16} {cluster.world_size:>5} {batch:>6} {grid:<8} {best.solver.candidates:>7} {fit:>5} {simulated:>9} "
                  f"{wall:>8.2f} {cpu:>6.2f} {target:>7}  {layout.removeprefix('layout ')} "
                  f"({best.predicted.step_time_s:.2f} s, {best.predicted.mfu:.1%}{'' if best.predicted.fits else ', DOES NOT FIT'})")


if __name__ == "__main__":
    main()

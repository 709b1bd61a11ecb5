"""Regenerates the solved example plans: python scripts/regenerate_examples.py [--out DIR] [--only NAME ...].

Tiny zoo models on 2-4 local CPU ranks (run them: mmplan run plans/examples/<file>), and real-size models for
reading. The hand-written tiny-vlm-dp2.json and tiny-vlm-pp2.json, and tiny-vlm-per-group-micro-batch-4xlocal-cpu.json
(written by `mmplan solve --layout 'vision:dp=2,micro-batch=1;llm:tp=2,micro-batch=1'` at global batch 8: NVIDIA's layout
in small), are not touched. Solving is deterministic
(no time limit), so a regeneration reproduces the files except for the solver's time_s.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# (file stem, zoo model, cluster, global batch, placement)
EXAMPLES: tuple[tuple[str, str, str, int, str], ...] = (
    ("tiny-avlm-non-colocated-4xlocal-cpu", "tiny-avlm", "4xlocal-cpu", 16, "non-colocated"),  # encoders on own ranks, LLM dp 2
    ("tiny-vlm-heavy-non-colocated-4xlocal-cpu", "tiny-vlm-heavy", "4xlocal-cpu", 8, "non-colocated"),  # encoder pipelined over 2
    ("tiny-vlm-colocated-2xlocal-cpu", "tiny-vlm", "2xlocal-cpu", 32, "colocated"),  # encoder colocated with the LLM
    ("tiny-flamingo-colocated-2xlocal-cpu", "tiny-flamingo", "2xlocal-cpu", 32, "colocated"),  # cross-attention consumer
    ("tiny-vlm-heavy-chain-4xlocal-cpu", "tiny-vlm-heavy", "4xlocal-cpu", 64, "auto"),  # one layout, DP cut points
    ("llava-1.5-13b-solved-64xh100-sxm", "llava-1.5-13b", "64xh100-sxm", 64, "auto"),
    ("vit22b-llama70b-non-colocated-128xh100-sxm", "vit22b-llama70b", "128xh100-sxm", 128, "non-colocated"),
)
TINY = tuple(e[0] for e in EXAMPLES if e[1].startswith("tiny-"))
HERE = Path(__file__).resolve().parents[1] / "plans" / "examples"


def regenerate(out: Path = HERE, only: tuple[str, ...] | None = None) -> list[Path]:
    """Solve every example (or those named in `only`) and write <stem>.json into `out`; returns the paths."""
    from cost_models.cluster_spec import parse_cluster
    from planner.profiler.profile import profile_model
    from planner.solver.solve import solve
    from plans.plan import save_plan
    from runtime.source import resolve

    profiles = {}
    written = []
    for stem, model, cluster, batch, placement in EXAMPLES:
        if only is not None and stem not in only:
            continue
        if model not in profiles:
            profiles[model] = profile_model(resolve(model))
        # Each example shows the structure in its name, so a named placement is solved without the baselines
        # (which would be emitted when faster); the tiny ones keep ZeRO 0, which every runtime path trains on CPU ranks.
        shape = dict(placement=placement, baseline=placement == "auto")
        zeros = dict(zeros=(0,)) if model.startswith("tiny-") else {}
        solution = solve(profiles[model], parse_cluster(cluster), batch, **shape, **zeros)
        path = out / f"{stem}.json"
        save_plan(solution.plan, path)
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=HERE)
    parser.add_argument("--only", nargs="*", help="file stems to regenerate (default: all)")
    args = parser.parse_args(argv)
    for path in regenerate(args.out, tuple(args.only) if args.only else None):
        print(f"wrote {path}")


if __name__ == "__main__":
    main()

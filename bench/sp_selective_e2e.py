"""A solver-built non-colocated plan on 3 local CPU ranks: vision tp = 1 (its 17-token ViT cannot be sequence-parallel
over 2), the LLM tp = 2 with sequence parallelism and selective recompute (hand-forced: the solver offers tp > 1 only on
GPU clusters). Made by the solver's own code: Segments -> _layouts_of -> build_layouts -> save_plan.

Run: python bench/sp_selective_e2e.py tiny-vlm OUT_DIR && python -m planner.cli run OUT_DIR/plan.json --steps 5
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from cost_models.cluster_spec import parse_cluster
from planner.solver.candidates import _layouts_of, sp_divides
from planner.solver.space import SELECTIVE, Setting
from planner.solver.structure import profile_units
from planner.profiler.profile import profile_model
from planner.solver.search import build_layouts
from planner.solver.segments import Segments
from plans.graph import save_profile
from plans.plan import save_plan
from runtime.source import resolve
OUT = sys.argv[2]
prof = profile_model(resolve(sys.argv[1]))
save_profile(prof, OUT + "/profile.json")
cl = parse_cluster("3xlocal-cpu")
st = Setting(cl, 8, "1f1b", prof.dtype if prof.dtype in ("fp32", "bf16", "fp16") else "fp32", policies=(SELECTIVE,))
units = profile_units(prof, "non-colocated")
sink = next(i for i, u in enumerate(units) if u.feeds)
print("units", [u.name for u in units], "sp divides at tp=2:", [sp_divides(u.blocks, 2) for u in units])
lays = []
for i, u in enumerate(units):
    if i == sink:
        seg = Segments(u, st, 2, 1, 0, 4, sequence_parallel=True)
        lays.append(_layouts_of(seg, 1, (), True)[0])
    else:
        seg = Segments(u, st, 1, 1, 0, 4)
        lays.append(_layouts_of(seg, 1, (1,), True)[0])
plan = build_layouts(prof, cl, 8, "1f1b", "non-colocated", units, tuple(lays))
for g in plan.groups:
    print(g.name, "tp", g.tp, "sp", g.sequence_parallel, "ranks", g.ranks, "tiers", sorted(set(g.stages[0].memory.activations.values())))
print("predicted step", plan.predicted.step_time_s, "fits", plan.predicted.fits)
save_plan(plan, OUT + "/plan.json")

"""An Evaluation's timeline as a Chrome / Perfetto JSON trace (load it in ui.perfetto.dev or chrome://tracing);
the format is plans/trace.py's, shared with the runtime's measured trace (mmplan run --trace)."""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

from cost_models.evaluate import Evaluation
from plans.trace import chrome_trace as _chrome_trace
from plans.trace import spans


def chrome_trace(evaluation: Evaluation, *, ranks: Iterable[int] | None = None) -> dict:
    """The trace of `ranks` (default: one representative rank per rank class; any rank of the plan may be
    asked for — its events are its representative's)."""
    sim = evaluation.simulation
    stands_for: dict[int, list[int]] = defaultdict(list)
    for r, rep in sim.representative.items():
        stands_for[rep].append(r)
    by_rank = defaultdict(list)
    for e in sim.timeline:
        by_rank[e.rank].append((e.lane, e.name, e.start, e.end))
    chosen = sorted(stands_for) if ranks is None else sorted(set(ranks))
    labels = {r: f"stands for {len(stands_for[r])} ranks: {spans(sorted(stands_for[r]))}"
              for r in chosen if ranks is None and len(stands_for[r]) > 1}
    p = evaluation.predicted
    return _chrome_trace({r: by_rank[sim.representative[r]] for r in chosen}, labels=labels,
                         other={"step_time_s": p.step_time_s, "bubble_fraction": p.bubble_fraction, "mfu": p.mfu})

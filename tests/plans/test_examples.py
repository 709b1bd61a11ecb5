"""plans/examples: the solved example plans validate against their models and are reproduced by scripts/regenerate_examples.py."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from plans.plan import load_plan

EXAMPLES_DIR = Path(__file__).resolve().parents[2] / "plans" / "examples"


def _regenerate_module():
    spec = importlib.util.spec_from_file_location("regenerate_examples", EXAMPLES_DIR.parents[1] / "scripts" / "regenerate_examples.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


REGEN = _regenerate_module()
SOLVED = {stem: (model, cluster) for stem, model, cluster, _, _ in REGEN.EXAMPLES}


def test_every_solved_example_is_there_and_the_hand_written_ones_are_kept():
    names = {p.stem for p in EXAMPLES_DIR.glob("*.json")}
    assert set(SOLVED) <= names
    assert {"tiny-vlm-dp2", "tiny-vlm-pp2", "tiny-vlm-per-group-micro-batch-4xlocal-cpu"} <= names


@pytest.fixture(scope="module")
def profiles():
    from planner.profiler.profile import profile_model
    from runtime.source import resolve

    cache = {}

    def get(model):
        if model not in cache:
            cache[model] = profile_model(resolve(model))
        return cache[model]

    return get


@pytest.mark.parametrize("stem", REGEN.TINY)
def test_tiny_examples_validate_and_the_runtime_can_run_them(stem, profiles):
    model, cluster = SOLVED[stem]
    plan = load_plan(EXAMPLES_DIR / f"{stem}.json", profile=profiles(model))  # fingerprint, blocks, boundaries
    assert plan.cluster.name == cluster and plan.cluster.backend == "gloo" and 2 <= plan.cluster.world_size <= 4
    assert plan.training.schedule in ("gpipe", "1f1b") and plan.training.virtual_stages == 1
    assert all(g.tp == 1 and g.zero == 0 for g in plan.groups)  # what the runtime executes on CPU ranks
    assert plan.predicted is not None and plan.predicted.fits
    if stem == "tiny-vlm-heavy-non-colocated-4xlocal-cpu" and plan.solver.method == "baseline:homogeneous":
        # issue 11 (costmodel branch): with memory-bound work priced, the best homogeneous plan (11.2 ms) beats the
        # best non-colocated one (11.65 ms) on this example, so solve emits the baseline; the lead re-chooses the
        # example's batch after merging the solver's baselines (item 6)
        pytest.xfail("solve emits the homogeneous baseline for this example under the op-class cost model")
    assert plan.solver.method.startswith("ilp+dp:")


@pytest.mark.slow
@pytest.mark.parametrize("stem", [s for s in SOLVED if s not in REGEN.TINY])
def test_large_examples_validate(stem, profiles):
    model, _ = SOLVED[stem]
    plan = load_plan(EXAMPLES_DIR / f"{stem}.json", profile=profiles(model))
    assert plan.predicted.fits and plan.solver.method.startswith("ilp+dp:")


@pytest.mark.parametrize("path", sorted(EXAMPLES_DIR.glob("*.json")), ids=lambda p: p.name)
def test_every_example_loads(path):
    load_plan(path)


def _without_times(path: Path) -> dict:
    data = json.loads(path.read_text())
    if data.get("solver"):
        data["solver"].pop("time_s", None)
    return data


def _check_reproduced(stems, tmp_path):
    for path in REGEN.regenerate(tmp_path, tuple(stems)):
        assert _without_times(path) == _without_times(EXAMPLES_DIR / path.name), f"{path.name} differs; run scripts/regenerate_examples.py"


def test_tiny_examples_are_reproduced_by_regenerate(tmp_path):
    _check_reproduced(REGEN.TINY, tmp_path)


@pytest.mark.slow
def test_large_examples_are_reproduced_by_regenerate(tmp_path):
    _check_reproduced([s for s in SOLVED if s not in REGEN.TINY], tmp_path)

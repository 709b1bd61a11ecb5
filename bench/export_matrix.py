"""Issue 29's matrix: 11 plan kinds x 5 export targets. Each cell says whether the export loads with the target's real
code and means what the plan means (one test per target in tests/planner/test_export_semantics.py: Megatron-LM's
parse_args + validate_args at core_v0.16.1, the pinned MIMO args of Megatron-LM main, Megatron-Bridge's pinned MIMO
config with megatron-core's TransformerConfig after apply() onto a recipe, torchtitan 0.3.0's ParallelDims / reshard
policy / AC after apply(), DeepSpeed 0.19.8's DeepSpeedConfig), whether its --lossy list is complete and the strict
error names all of it (test_the_lossy_list_is_complete_...), and what the export is: exact, lossy with N listed
changes, or refused (the refusal's reason).

Run: python bench/export_matrix.py  (runs those tests once with pytest, ~5 minutes on a loaded 2-core host; needs the
[export] extra). Prints a Markdown table to paste into a note.
"""
from __future__ import annotations

import re
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TEST = "tests/planner/test_export_semantics.py"
# target -> the test that loads its export with the target's code and checks what the fields mean
LOADS = {"megatron": "test_megatron_lm_validates_every_kind_and_runs_its_zero_sp_and_recompute",
         "megatron-mimo": "test_megatron_mimo_validates_the_encoder_apart_and_refuses_the_rest",
         "megatron-bridge": "test_megatron_bridge_apply_sets_every_field_on_a_recipe",
         "torchtitan": "test_torchtitan_apply_sets_reshard_policy_and_activation_checkpointing",
         "deepspeed": "test_deepspeed_config_as_initialize_builds_it"}
LOSSY = "test_the_lossy_list_is_complete_and_the_strict_error_names_all_of_it"


def outcomes() -> dict[str, str]:
    """Test id (function[params]) -> passed | failed | skipped, from one pytest run."""
    with tempfile.TemporaryDirectory(prefix="export-matrix-") as d:
        xml = Path(d) / "junit.xml"
        subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:warnings", TEST, f"--junitxml={xml}",
                        "-k", " or ".join([*LOADS.values(), LOSSY])], cwd=ROOT, check=False,
                       env={**__import__("os").environ, "PYTHONPATH": str(ROOT)})
        out = {}
        for case in ET.parse(xml).getroot().iter("testcase"):
            status = "failed" if case.find("failure") is not None or case.find("error") is not None else \
                "skipped" if case.find("skipped") is not None else "passed"
            out[case.get("name")] = status
        return out


def what(plan, target: str) -> str:
    """exact | lossy (N changes listed) | refused: the reason, shortened."""
    from planner.export import export_plan
    from planner.export.common import Unsupported

    try:
        dropped = export_plan(plan, target, lossy=True).dropped
    except Unsupported as e:
        instead = re.findall(r"`(--to [^`]+)`", str(e))  # the target the refusal names instead
        return f"refused: {'; '.join(instead)} instead" if instead else f"refused: {str(e)[:60]}"
    return f"lossy ({len(dropped)} listed)" if dropped else "exact"


def main() -> None:
    from tests.planner.test_export_semantics import KINDS, TARGETS, build_kinds, build_profiles

    results = outcomes()
    kinds = build_kinds(build_profiles())
    mark = {"passed": "ok", "failed": "FAIL", "skipped": "skip", None: "-"}
    print("cells: loads with the real code & semantics checked / lossy list complete / what the export is\n")
    print("| kind | " + " | ".join(TARGETS) + " |")
    print("|---|" + "---|" * len(TARGETS))
    failed = 0
    for kind in KINDS:
        cells = []
        for target in TARGETS:
            load = results.get(f"{LOADS[target]}[{kind}]")
            lossy = results.get(f"{LOSSY}[{kind}-{target}]")
            failed += (load != "passed") + (lossy != "passed")
            cells.append(f"{mark[load]} / {mark[lossy]} / {what(kinds[kind], target)}")
        print(f"| {kind} | " + " | ".join(cells) + " |")
    print(f"\n{len(KINDS) * len(TARGETS)} cells, {failed} checks not passed (target: 0)")


if __name__ == "__main__":
    main()

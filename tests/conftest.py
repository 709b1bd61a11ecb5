"""Tests kept out of the default run for time only: each repeats, at several times the cost, what a cheaper test of
the default run already checks (the cheaper one named beside it). They are marked `slow` here, in one list, so the
default suite stays near ten minutes on 2 cores. They are also marked `ci_slow`: CI runs them after the default
run (`python -m pytest -m ci_slow`, .ci/run); `python -m pytest -m slow` runs every slow test."""
from __future__ import annotations

import os

import pytest

# node id (without the "tests/" prefix) -> the default-run test that covers the same behaviour more cheaply.
# Durations are from a full default run on this 2-core machine at load 12-15 (2026-12-03).
CI_SLOW = {
    # 340 s: every README Guide command; the Quickstart's `mmplan demo` stays in the default run
    "test_readme.py::test_every_guide_command_runs_in_order": "test_readme.py::test_quickstart_main_command_verbatim",
    # 72 s each: three groups on four ranks; clip-disjoint-towers and flamingo-xattn-2-stages cover non-colocated
    # towers, tests/runtime/test_mechanisms_parity.py colocated groups
    "runtime/test_parity.py::test_plan_matches_single_process_reference[avlm-non-colocated]":
        "runtime/test_parity.py::test_plan_matches_single_process_reference[clip-disjoint-towers]",
    "runtime/test_parity.py::test_plan_matches_single_process_reference[avlm-colocated]":
        "runtime/test_mechanisms_parity.py (colocated-fills-bubbles)",
    # 72 s / 34 s: parameters and gradients on NVMe; the other case covers the optimizer and activation tiers, and
    # tests/runtime/test_memory_tiers.py every tier's bytes
    "runtime/test_tiers.py::test_tier_options_keep_loss_parity[params-nvme+grads-cpu+offload-nvme | params-cpu+grads-nvme+optimizer-nvme]":
        "runtime/test_tiers.py::test_tier_options_keep_loss_parity[optimizer-cpu+offload-cpu | optimizer-nvme+recompute]",
    "runtime/test_tiers.py::test_a_bf16_plans_tiers_hold_its_fp32_masters_and_keep_parity[params-nvme+grads-cpu+offload-nvme | params-cpu+grads-nvme+optimizer-nvme]":
        "runtime/test_tiers.py::test_a_bf16_plans_tiers_hold_its_fp32_masters_and_keep_parity[optimizer-cpu+offload-cpu | optimizer-nvme+recompute]",
    # 57 s: ZeRO-3 kept gathered with a pipeline; the dp2 case runs the same option
    "runtime/test_zero.py::test_zero3_without_reshard_after_forward_matches_reference[pp2-dp2-zero3-kept]":
        "runtime/test_zero.py::test_zero3_without_reshard_after_forward_matches_reference[dp2-zero3-kept]",
    # 46 s: a dp2 checkpoint resumed under pp2; tests/runtime/test_dcp_checkpoint.py resumes across plans (dp2 -> pp2
    # among them) in the default format
    "runtime/test_resume.py::test_a_dp2_checkpoint_resumes_under_a_pp2_plan_with_parity":
        "runtime/test_dcp_checkpoint.py",
    # 36 s loaded: a --layout colocated group filling an interleaved LLM's bubbles; the pp2 case of the same file covers
    # --layout colocation, tests/runtime/test_mechanisms_parity.py (colocated-fills-bubbles) the filled bubbles
    "runtime/test_colocated_layout_parity.py::test_a_colocated_layout_trains_like_the_reference[colocated-fill-interleaved]":
        "runtime/test_colocated_layout_parity.py::test_a_colocated_layout_trains_like_the_reference[colocated-llm-pp2-layers]",
}


# The files that take longest in the default run (seconds on one process, this 2-core machine, 2026-12-04): they
# are handed to the xdist workers first (longest first), so that none of them starts last and runs alone at the end
# (the README's Quickstart test, 100-190 s, comes last in collection order; measured gain small: 985.7 -> 972.4 s).
# Order only: a file missing here runs in collection order after these.
LONGEST_FILES = (
    "planner/test_solve.py",  # 257 s
    "test_readme.py",  # 103 s
    "runtime/test_zero.py",  # 74 s
    "runtime/test_resume.py",  # 72 s
    "runtime/test_parity.py",  # 61 s
    "runtime/test_mechanisms_parity.py",  # 59 s
    "runtime/test_rebatching_parity.py",  # 48 s
    "planner/test_export_targets.py",  # 44 s
    "planner/test_export_semantics.py",  # 44 s
    "hf/test_hf_varimg.py",  # 43 s
)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Mark the CI_SLOW tests slow before `-m 'not slow'` deselects; the LONGEST_FILES first."""
    for item in items:
        nodeid = item.nodeid.removeprefix("tests/")
        if nodeid in CI_SLOW:
            item.add_marker(pytest.mark.slow)
            item.add_marker(pytest.mark.ci_slow)
    rank = {name: i for i, name in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: rank.get(item.nodeid.removeprefix("tests/").split("::")[0], len(rank)))


# pytest-xdist's `-n auto` (pyproject.toml's addopts): one worker per core, at most MAX_WORKERS -- the multi-rank
# tests start 2-4 processes of their own, and each worker holds its own torch and session fixtures
MAX_WORKERS = 4


def pytest_xdist_auto_num_workers(config):
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(MAX_WORKERS, cores))

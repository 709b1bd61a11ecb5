"""`mmplan run` on the cluster it actually runs on: which cluster that is, the plan's prediction there, and the one-line
warning when the plan was solved for another cluster (an H100 plan run on CPU)."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from plans.cluster import Cluster
from plans.graph import Profile
from plans.plan import Plan, Predicted


@dataclass(frozen=True, slots=True)
class Actual:
    cluster: Cluster  # the cluster the run is on
    same: bool  # whether the plan was solved for that kind of device and backend
    predicted: Predicted | None  # the plan's figures on `cluster` (None: the same kind, or no profile to evaluate with)
    warning: str | None  # the one line to print when not `same`

    @property
    def predicted_step_s(self) -> float | None:
        return self.predicted.step_time_s if self.predicted is not None else None


def actual_cluster(plan: Plan, backend: str) -> Cluster:
    """This machine as the run uses it: with nccl, the plan's cluster when CUDA's device is the plan's kind, else the
    catalog entry of that GPU on the plan's nodes (an unknown GPU: the plan's figures under CUDA's name, and the
    warning says so); with gloo, local-cpu ranks, one per rank of the plan, on the nodes of the plan."""
    from cost_models.catalog import CATALOG
    from cost_models.cluster_spec import catalog_cluster

    if backend == "nccl" and torch.cuda.is_available():
        name = torch.cuda.get_device_name(0)
        probe = Profile("", "", "fp32", 1, (), (), measured_on=name)
        from cost_models.compute import measured_on

        if measured_on(probe, plan.cluster):  # the plan's own kind of GPU: its figures
            return plan.cluster
        for entry, cluster in CATALOG.items():  # a catalog GPU of that name (its datasheet figures), same nodes
            if cluster.backend == "nccl" and measured_on(probe, cluster):
                found = catalog_cluster(entry)
                return replace(found, name=f"{plan.cluster.world_size}x{entry}", nodes=plan.cluster.nodes,
                               gpus_per_node=plan.cluster.gpus_per_node)
        return replace(plan.cluster, device=replace(plan.cluster.device, name=name))  # unknown GPU: named only

    local = catalog_cluster(f"{plan.cluster.world_size}xlocal-cpu")
    return replace(local, nodes=plan.cluster.nodes, gpus_per_node=plan.cluster.gpus_per_node) \
        if plan.cluster.world_size % plan.cluster.gpus_per_node == 0 else local


def _same_kind(planned: Cluster, actual: Cluster) -> bool:
    if planned.backend != actual.backend:
        return False
    from cost_models.compute import measured_on

    # one device's name read as a profile's "measured on": "local-cpu" and "cpu: AMD EPYC" match, "h100-sxm" and
    # "NVIDIA H100 80GB HBM3" match, "h100-sxm" and "local-cpu" do not
    probe = Profile("", "", "fp32", 1, (), (), measured_on=actual.device.name)
    return planned.device.name == actual.device.name or measured_on(probe, planned) or measured_on(
        replace(probe, measured_on=planned.device.name), actual)


def on_actual_cluster(plan: Plan, profile: Profile | None, backend: str, *, evaluation: Any = None) -> Actual:
    """The cluster this run is on and, when the plan was solved for another kind, the plan's prediction on it
    (with `profile`, else none) and a one-line warning. `evaluation`: the plan already evaluated on that cluster
    (cost_models.evaluate.Evaluation), used instead of evaluating it again."""
    actual = actual_cluster(plan, backend)
    if _same_kind(plan.cluster, actual):
        return Actual(actual, True, None, None)
    predicted = evaluation.predicted if evaluation is not None else None
    if predicted is None and profile is not None:
        from cost_models.evaluate import evaluate

        predicted = evaluate(plan, profile, actual).predicted
    here = f"predicted step here {predicted.step_time_s * 1e3:.1f} ms" if predicted is not None else \
        "pass --profile to predict it here"
    planned = plan.predicted.step_time_s if plan.predicted is not None else None
    was = f", {planned * 1e3:.1f} ms there" if planned is not None else ""
    warning = (f"warning: the plan was solved for {plan.cluster.name} ({plan.cluster.device.name}, {plan.cluster.backend}) "
               f"but runs on {actual.device.name} ({actual.backend}): {here}{was}")
    return Actual(actual, False, predicted, warning)


__all__ = ["Actual", "actual_cluster", "on_actual_cluster"]

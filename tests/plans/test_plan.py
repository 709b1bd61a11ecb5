"""plan.json: schema, round trip, consistency checks with clear errors, hand-written plans."""
from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import pytest

from plans import plan as P
from plans.cluster import Cluster, Device, Link
from plans.errors import FormatError
from plans.graph import Block, Edge, InputEdge, Profile, check
from plans.stage_graph import Transfer, stage_graph
from plans.serial import dumps, schema, to_data

EXAMPLES = Path(P.__file__).parent / "examples"

# A tiny VLM: vision tower -> projector -> LLM (whose embedding also feeds its first layer).
BLOCKS = [
    ("vision.patch", "vision"), ("vision.layers.0", "vision"), ("vision.layers.1", "vision"),
    ("projector", "projector"),
    ("llm.embed", "llm"), ("llm.layers.0", "llm"), ("llm.layers.1", "llm"), ("llm.head", "llm"),
]
EDGES = [
    ("vision.patch", "vision.layers.0"), ("vision.layers.0", "vision.layers.1"), ("vision.layers.1", "projector"),
    ("projector", "llm.layers.0"), ("llm.embed", "llm.layers.0"), ("llm.layers.0", "llm.layers.1"), ("llm.layers.1", "llm.head"),
]


def make_profile() -> Profile:
    blocks = tuple(
        Block(name=n, group=g, kind="Linear", params=10, param_bytes=40, fwd_flops=1e6, bwd_flops=2e6,
              activation_bytes=64.0, output_bytes=32.0, supports_tp=g == "llm", signature=n)
        for n, g in BLOCKS
    )
    edges = tuple(Edge(s, d, 32.0) for s, d in EDGES)
    inputs = (InputEdge("pixels", "vision.patch", 3072.0), InputEdge("tokens", "llm.embed", 64.0))
    return Profile.build("tiny-test", "fp32", 2, blocks, edges, inputs)


PROFILE = make_profile()


def make_cluster(nodes: int = 3) -> Cluster:
    return Cluster(
        name="test", nodes=nodes, gpus_per_node=2,
        device=Device("test-gpu", {"fp32": 1e12, "bf16": 4e12}, 8 * 2**30, 1e12),
        intra_node=Link(1e11, 1e-6), inter_node=Link(1e10, 1e-5), host_to_device=Link(2e10, 1e-5), nvme=Link(2e9, 1e-4),
        host_memory_bytes=64 * 2**30, nvme_bytes=2**40, backend="gloo",
    )


def make_plan() -> P.Plan:
    """vision dp2 on ranks 0-1, projector colocated with it, LLM dp1 x tp2 on ranks 2-3, with predictions."""
    vision = P.Group("vision", dp=2, tp=1, pp=1, stages=(P.Stage(("vision.patch", "vision.layers.0", "vision.layers.1"), (0, 1)),))
    projector = P.Group("projector", dp=2, tp=1, pp=1, stages=(P.Stage(("projector",), (0, 1)),), colocated_with="vision")
    llm_memory = P.Memory(optimizer="cpu", activations={"llm.layers.0": "recompute", "llm.layers.1": "offload-cpu"})
    llm = P.Group("llm", dp=1, tp=2, pp=1, zero=1,
                  stages=(P.Stage(("llm.embed", "llm.layers.0", "llm.layers.1", "llm.head"), (2, 3), llm_memory),))
    plan = P.Plan(
        profile=P.ProfileRef(PROFILE.model, PROFILE.fingerprint),
        cluster=make_cluster(),
        training=P.Training(global_batch=8, micro_batches=2, schedule="1f1b", dtype="bf16"),
        groups=(vision, projector, llm),
        predicted=P.Predicted(step_time_s=0.5, samples_per_s=16.0, tokens_per_s=1024.0, tflops_per_gpu=1.5, mfu=0.25,
                              bubble_fraction=0.2, comm_bytes=1e6, fits=True,
                              memory=tuple(P.RankMemory(r, 1e9, 2e8) for r in range(4)), bottleneck="llm/stage 0"),
        solver=P.SolverInfo("ilp+dp", objective=0.5, time_s=1.25, candidates=12),
    )
    return P.check_plan(plan, PROFILE)


def plan_data() -> dict:
    return json.loads(dumps(make_plan()))


# --- format -----------------------------------------------------------------------------------


def test_round_trip_is_byte_identical() -> None:
    text = dumps(make_plan())
    assert dumps(P.plan_from_data(json.loads(text), profile=PROFILE)) == text
    assert dumps(P.plan_from_data(json.loads(text))) == text


def test_save_and_load(tmp_path: Path) -> None:
    plan = make_plan()
    P.save_plan(plan, tmp_path / "plan.json")
    assert P.load_plan(tmp_path / "plan.json", profile=PROFILE) == plan
    assert [p.name for p in tmp_path.iterdir()] == ["plan.json"]


def test_load_reports_bad_json(tmp_path: Path) -> None:
    (tmp_path / "plan.json").write_text("{")
    with pytest.raises(FormatError, match="not valid JSON"):
        P.load_plan(tmp_path / "plan.json")


def test_hand_written_plan_loads_and_gets_the_profiles_flow() -> None:
    data = {
        "schema": "mmplan.plan/3",
        "profile": {"model": PROFILE.model, "fingerprint": PROFILE.fingerprint},
        "cluster": to_data(make_cluster(1)),
        "training": {"global_batch": 4, "micro_batches": 2},
        "groups": [
            {"name": "vision", "dp": 1, "tp": 1, "pp": 1, "stages": [{"blocks": [b for b, g in BLOCKS if g == "vision"], "ranks": [0]}]},
            {"name": "projector", "dp": 1, "tp": 1, "pp": 1, "stages": [{"blocks": ["projector"], "ranks": [0]}]},
            {"name": "llm", "dp": 1, "tp": 1, "pp": 1, "stages": [{"blocks": [b for b, g in BLOCKS if g == "llm"], "ranks": [1]}]},
        ],
    }
    data["groups"][1]["colocated_with"] = "vision"
    plan = P.plan_from_data(data, profile=PROFILE)
    assert plan.predicted is None and plan.solver is None
    assert plan.flow == P.flow_of(PROFILE)
    g = stage_graph(plan)
    assert [(r.block, g.chunks[r.dst].label) for r in g.routes] == [("vision.layers.1", "projector s0"), ("projector", "llm s0")]
    assert [t for r in g.routes for t in g.transfers(r)] == [Transfer(0, 0, 0, 2), Transfer(0, 1, 0, 2)]
    assert P.plan_from_data(data).flow is None  # no profile: nothing to take it from


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.json")) or [None], ids=lambda p: p.name if p else "none")
def test_examples_load(path: Path | None) -> None:
    if path is None:
        pytest.skip("no example plans yet")
    P.load_plan(path)  # without a profile: the zoo is not needed here


def _dataclass_schemas() -> list[tuple[type, dict]]:
    defs = schema("plan")["$defs"]
    pairs = {P.ProfileRef: "profile_ref", Cluster: "cluster", Device: "device", Link: "link", P.Training: "training",
             P.Memory: "memory", P.Stage: "stage", P.Group: "group", P.Flow: "flow",
             P.RankMemory: "rank_memory", P.Predicted: "predicted", P.SolverInfo: "solver"}
    return [(P.Plan, schema("plan"))] + [(cls, defs[name]) for cls, name in pairs.items()]


@pytest.mark.parametrize("cls,sub", _dataclass_schemas(), ids=lambda x: getattr(x, "__name__", ""))
def test_schema_matches_dataclasses(cls: type, sub: dict) -> None:
    fields = dataclasses.fields(cls)
    assert set(sub["properties"]) == {f.name for f in fields}
    no_default = [f.name for f in fields if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    assert set(sub.get("required", [])) == set(no_default) | ({"schema"} if cls is P.Plan else set())
    assert sub["additionalProperties"] is False
    for name, prop in sub["properties"].items():
        target = schema("plan")["$defs"][prop["$ref"].split("/")[-1]] if "$ref" in prop else prop
        assert prop.get("description") or target.get("description"), f"{cls.__name__}.{name} has no description"


# --- malformed plans: each rejected with one sentence naming the problem ----------------------


def _set(path: str, value):
    """A mutation setting data[path] (dot-separated; ints index lists); value DELETE removes it."""
    def mutate(d: dict) -> None:
        *head, last = [int(k) if k.isdigit() else k for k in path.split(".")]
        for k in head:
            d = d[k]
        if value is DELETE:
            del d[last]
        else:
            d[last] = copy.deepcopy(value)
    return mutate


DELETE = object()
VISION, PROJ, LLM = "groups.0", "groups.1", "groups.2"
LLM_BLOCKS = ["llm.embed", "llm.layers.0", "llm.layers.1", "llm.head"]

MALFORMED = {
    "wrong type": ([_set(f"{VISION}.dp", "2")], ["groups/0/dp", "not of type"]),
    "missing field": ([_set("training.global_batch", DELETE)], ["global_batch", "required"]),
    "unknown field": ([_set(f"{VISION}.colour", "red")], ["colour", "unexpected"]),
    "wrong schema version": ([_set("schema", "mmplan.plan/0")], ["'mmplan.plan/0'", "expected", "'mmplan.plan/3'"]),
    "missing schema version": ([_set("schema", DELETE)], ["no 'schema' field", "expected"]),
    "missing block": ([_set(f"{LLM}.stages.0.blocks", LLM_BLOCKS[:3])], ["'llm.head'", "missing"]),
    "block placed twice": ([_set(f"{VISION}.stages.0.blocks", ["vision.patch", "vision.layers.0", "vision.layers.1", "projector"])], ["'projector'", "placed twice"]),
    "block not in profile": ([_set(f"{LLM}.stages.0.blocks", LLM_BLOCKS + ["llm.ghost"])], ["'llm.ghost'", "not in the profile"]),
    "blocks out of order": ([_set(f"{LLM}.stages.0.blocks", LLM_BLOCKS[::-1])], ["execution order"]),
    "overlapping ranks": ([_set(f"{LLM}.tp", 1), _set(f"{LLM}.dp", 2), _set(f"{LLM}.stages.0.ranks", [1, 2])], ["'vision'", "'llm'", "share rank 1", "not colocated"]),
    "dp*tp != stage ranks": ([_set(f"{LLM}.stages.0.ranks", [2])], ["1 ranks", "dp*tp = 1*2 = 2"]),
    "pp != stages": ([_set(f"{LLM}.pp", 2)], ["'llm'", "pp=2", "1 stages"]),
    "rank twice in group": ([_set(f"{LLM}.tp", 1), _set(f"{LLM}.pp", 2),
                             _set(f"{LLM}.stages", [{"blocks": LLM_BLOCKS[:2], "ranks": [2]}, {"blocks": LLM_BLOCKS[2:], "ranks": [2]}])],
                            ["'llm'", "rank 2 twice"]),
    "rank out of range": ([_set(f"{LLM}.stages.0.ranks", [6, 7])], ["rank 6", "out of range", "6 ranks"]),
    "negative rank": ([_set(f"{LLM}.stages.0.ranks", [-1, 2])], ["ranks/0", "minimum"]),
    "tp across nodes": ([_set(f"{LLM}.stages.0.ranks", [3, 4])], ["tp ranks [3, 4]", "span nodes [1, 2]"]),
    "unknown tier": ([_set(f"{LLM}.stages.0.memory.params", "disk")], ["memory/params", "'disk' is not one of"]),
    "unknown activation tier": ([lambda d: d["groups"][2]["stages"][0]["memory"]["activations"].update({"llm.head": "swap"})], ["activations/llm.head", "'swap' is not one of"]),
    "unknown schedule": ([_set("training.schedule", "zigzag")], ["training/schedule", "'zigzag' is not one of"]),
    "unknown dtype": ([_set("training.dtype", "fp8")], ["training/dtype", "'fp8'"]),
    "global batch not divisible": ([_set("training.global_batch", 9)], ["global_batch 9", "not divisible by micro_batches 2"]),
    "micro-batch not divisible by dp": ([_set("training.global_batch", 6)], ["'vision'", "micro-batch of 3 samples", "dp=2"]),
    "virtual stages without interleaved": ([_set("training.virtual_stages", 2)], ["virtual_stages 2", "'interleaved'"]),
    "zero out of range": ([_set(f"{LLM}.zero", 4)], ["groups/2/zero", "maximum of 3"]),
    "colocated with unknown group": ([_set(f"{PROJ}.colocated_with", "vsion")], ["'projector'", "'vsion'", "not another group"]),
    "colocated with itself": ([_set(f"{PROJ}.colocated_with", "projector")], ["'projector'", "not another group"]),
    "colocated rank sets differ": ([_set(f"{PROJ}.dp", 1), _set(f"{PROJ}.stages.0.ranks", [0])], ["'projector'", "'vision'", "rank sets differ"]),
    "colocation cycle": ([_set(f"{VISION}.colocated_with", "projector")], ["cycle"]),
    "duplicate group name": ([_set(f"{PROJ}.name", "vision"), _set(f"{PROJ}.colocated_with", None)], ["'vision'", "used twice"]),
    "fingerprint mismatch": ([_set("profile.fingerprint", "0123456789abcdef")], ["another model", "0123456789abcdef", PROFILE.fingerprint]),
    "bad fingerprint format": ([_set("profile.fingerprint", "xyz")], ["profile/fingerprint", "does not match"]),
    "activation tier for a block of another stage": ([_set(f"{VISION}.stages.0.memory", {"activations": {"llm.head": "keep"}})], ["'vision' stage 0", "'llm.head'", "not a block of this stage"]),
    "flow differs": ([_set("flow.edges.0", ["vision.layers.0", "projector"])], ["data flow differs", "edge"]),
    "flow against the execution order": ([_set("flow.edges.0", ["projector", "vision.layers.0"])], ["data flow differs"]),
    "flow missing": ([_set("flow", DELETE)], None),  # not an error: taken from the profile again
    "predicted wrong type": ([_set("predicted.fits", "yes")], ["predicted/fits", "not of type 'boolean'"]),
    "empty object": ([lambda d: d.clear()], ["no 'schema' field"]),
}


@pytest.mark.parametrize("case", list(MALFORMED), ids=list(MALFORMED))
def test_malformed_plan_is_rejected(case: str) -> None:
    mutations, words = MALFORMED[case]
    data = plan_data()
    for m in mutations:
        m(data)
    if words is None:
        assert P.plan_from_data(data, profile=PROFILE) == make_plan()
        return
    with pytest.raises(FormatError) as err:
        P.plan_from_data(data, "plan x.json", profile=PROFILE)
    message = str(err.value)
    assert message.startswith("plan x.json: ") and "\n" not in message
    for w in words:
        assert w in message, f"{w!r} not in {message!r}"


def test_block_twice_without_profile() -> None:
    data = plan_data()
    data["groups"][0]["stages"][0]["blocks"].append("projector")
    with pytest.raises(FormatError, match="'projector' is placed twice"):
        P.plan_from_data(data)


def test_flow_edge_against_the_execution_order_without_profile() -> None:
    data = plan_data()
    data["flow"]["edges"][0] = ["projector", "vision.layers.0"]
    with pytest.raises(FormatError, match="against the execution order"):
        P.plan_from_data(data)


def test_non_object_plan() -> None:
    with pytest.raises(FormatError, match="no 'schema' field"):
        P.plan_from_data([1, 2])


def test_check_plan_catches_bad_literal_in_code() -> None:
    plan = dataclasses.replace(make_plan(), training=P.Training(8, 2, schedule="zigzag"))  # type: ignore[arg-type]
    with pytest.raises(FormatError, match="training/schedule"):
        P.check_plan(plan)
    with pytest.raises(FormatError, match="training/schedule"):
        P.save_plan(plan, "/nonexistent/never-written.json")


def test_nan_and_infinity_are_refused_on_load(tmp_path):
    """Python's json reads NaN and 1e999, JSON does not: a plan holding them could not be written back."""
    import json as _json

    from plans.errors import FormatError
    from plans.serial import read_json

    for token in ("NaN", "Infinity", "1e999"):
        path = tmp_path / "p.json"
        path.write_text('{"step_time_s": ' + token + "}")
        with pytest.raises(FormatError, match="not a JSON number"):
            read_json(path, "plan")
    path.write_text(_json.dumps({"x": 1.5}))
    assert read_json(path, "plan") == {"x": 1.5}

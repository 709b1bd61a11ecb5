"""Fuzzing the loaders of every file a user hands mmplan: profile.json, plan.json, cluster TOML, architecture TOML.

Whatever they are given -- random JSON, valid documents with fields dropped, retyped or swapped, truncated or
garbled text, random TOML -- they either succeed or raise our own clear error (MmplanError / FormatError); never
a KeyError, TypeError, ValueError, RecursionError or anything else that would surface as a traceback.
"""
from __future__ import annotations

import copy
import io
import json
import math
import os
from pathlib import Path
from typing import Any, Callable

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cost_models.catalog import CATALOG
from cost_models.cluster_spec import parse_cluster
from cost_models.cluster_toml import cluster_from_toml, cluster_to_toml, load_cluster_toml
from plans.errors import MmplanError
from plans.graph import load_profile, profile_from_data
from plans.plan import load_plan, plan_from_data
from plans.serial import to_data

EXAMPLES = Path(__file__).resolve().parents[1] / "plans" / "examples"
ARCH_EXAMPLES = Path(__file__).resolve().parents[1] / "runtime" / "models" / "examples"

# Bounded so the file runs in well under 30 s on 2 cores; MMPLAN_FUZZ_EXAMPLES=2000 for a long hunt.
EXAMPLES_PER_TEST = int(os.environ.get("MMPLAN_FUZZ_EXAMPLES", "60"))
FUZZ = settings(max_examples=EXAMPLES_PER_TEST, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
FEW = settings(FUZZ, max_examples=max(1, EXAMPLES_PER_TEST // 2))


# --- the valid documents that get mutated ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def profile():
    from planner.profiler.profile import profile_model
    from runtime.source import resolve

    return profile_model(resolve("tiny-vlm"))


@pytest.fixture(scope="module")
def profile_doc(profile) -> dict:
    return to_data(profile)


@pytest.fixture(scope="module")
def plan_docs() -> list[dict]:
    """Hand-written plans of tiny-vlm (checked against its profile too) and the solved examples of other models."""
    names = ("tiny-vlm-pp2.json", "tiny-vlm-dp2.json")
    docs = [json.loads((EXAMPLES / name).read_text()) for name in names]
    others = [p for p in sorted(EXAMPLES.glob("*.json")) if p.name not in names and p.stat().st_size < 8000]
    return docs + [json.loads(p.read_text()) for p in others]


@pytest.fixture(scope="module")
def scratch(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("fuzz")


CLUSTER_TOMLS = [cluster_to_toml(CATALOG["h100-sxm"]), cluster_to_toml(CATALOG["local-cpu"]),
                 'base = "a100-40g"\nnodes = 2\nhost_memory_gb = 512\n[device]\nmemory_gb = 40\n'
                 '[links.nvme]\nbandwidth_gbps = 6\nlatency_us = 90\n']


def only_our_errors(load: Callable[[], Any]) -> None:
    """The contract: success, or an MmplanError with a one-sentence message."""
    try:
        load()
    except MmplanError as e:
        message = str(e)
        assert message.strip(), f"{type(e).__name__} without a message"
    # any other exception propagates and fails the test, with hypothesis' minimal example


# --- strategies ----------------------------------------------------------------------------------------------------

scalars = (st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.sampled_from([0, -1, 1, 2**63, 10**30])
           | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=12)
           | st.sampled_from(["", "gpu", "nvme", "1f1b", "interleaved", "fp32", "vision", "llm", "llm.head", "mmplan.plan/3",
                              "mmplan.profile/1", "0ad80f2dc6049a5a", "\x00", "\ud800"]))
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
                           max_leaves=12)


def _paths(doc: Any, prefix: tuple = ()) -> list[tuple]:
    out = [prefix]
    if isinstance(doc, dict):
        for k, v in doc.items():
            out += _paths(v, prefix + (k,))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            out += _paths(v, prefix + (i,))
    return out


def _leaves(doc: Any) -> list[Any]:
    if isinstance(doc, dict):
        return [x for v in doc.values() for x in _leaves(v)]
    if isinstance(doc, list):
        return [x for v in doc for x in _leaves(v)] + ([doc] if all(not isinstance(v, (list, dict)) for v in doc) else [])
    return [doc]


def _retype(value: Any) -> list[Any]:
    """The same content in other JSON types."""
    options: list[Any] = [None, [value], {"value": value}, str(value)]
    if isinstance(value, bool):
        options += [int(value), "true"]
    elif isinstance(value, (int, float)):
        options += [-value, 0, float(value) + 0.5, bool(value), math.nan, math.inf, -1]
        if isinstance(value, float) and math.isfinite(value):
            options.append(int(value))
    elif isinstance(value, str):
        options += [len(value), value[: len(value) // 2], value + "x", value.upper()]
    elif isinstance(value, list):
        options += [value[:-1], value + value[-1:], list(reversed(value)), {}, []]
    elif isinstance(value, dict):
        options += [[], list(value.values()), {}]
    return options


def _alike(value: Any, doc: Any) -> list[Any]:
    """Values of the same JSON type: small and edge-case numbers, other strings or lists of the document."""
    if isinstance(value, bool):
        return [not value]
    if isinstance(value, int):
        return [0, 1, 2, 3, 4, 8, -1, value + 1, value - 1, value * 2, 2**62]
    if isinstance(value, float):
        return [0.0, -1.0, value * 2, value / 3, 1e308, 5e-324]
    if isinstance(value, str):
        return [x for x in _leaves(doc) if isinstance(x, str)] + ["", value + ".x"]
    if isinstance(value, list):
        others = [x for x in _leaves(doc) if isinstance(x, list)]
        return [value[:-1], value[1:], value + value[-1:], list(reversed(value)), value[:1] * 2, *others[:6]]
    if isinstance(value, dict):
        return [{k: v for k, v in value.items() if k != drop} for drop in value] or [value]
    return [value]


@st.composite
def mutated(draw, docs: list[dict], max_mutations: int = 3) -> Any:
    """A valid document with 1..max_mutations fields dropped, retyped, swapped with another value of the document,
    replaced by random JSON, or a list shortened / lengthened."""
    doc = copy.deepcopy(draw(st.sampled_from(docs)))
    for _ in range(draw(st.integers(1, max_mutations))):
        paths = _paths(doc)
        path = draw(st.sampled_from(paths[1:] or paths))
        parent = doc
        for key in path[:-1]:
            parent = parent[key]
        key = path[-1] if path else None
        if key is None:
            return draw(json_values)
        value = parent[key]
        op = draw(st.sampled_from(["drop", "retype", "swap", "random", "alike", "alike", "alike"]))
        if op == "drop":
            del parent[key]
        elif op == "alike":  # same JSON type, so the schema passes more often and the consistency checks run
            parent[key] = copy.deepcopy(draw(st.sampled_from(_alike(value, doc))))
        elif op == "retype":
            parent[key] = draw(st.sampled_from(_retype(value)))
        elif op == "swap":
            parent[key] = copy.deepcopy(draw(st.sampled_from(_leaves(doc))))
        else:
            parent[key] = draw(json_values)
    return doc


@st.composite
def garbled(draw, texts: list[str]) -> str:
    """Valid text truncated, with a slice cut out, or with random characters spliced in."""
    text = draw(st.sampled_from(texts))
    i = draw(st.integers(0, len(text)))
    j = draw(st.integers(i, min(len(text), i + 40)))
    op = draw(st.sampled_from(["truncate", "cut", "splice", "splice"]))
    if op == "truncate":
        return text[:i]
    if op == "cut":
        return text[:i] + text[j:]
    pieces = list('{}[]",:=.\n#-+0123456789eE \\\'"tnf') + ["nan", "inf", "true", "\x00", "\ud800", "1" * 5000]
    junk = "".join(draw(st.lists(st.sampled_from(pieces), max_size=8)))
    return text[:i] + junk + text[j:]


def _dump(value: Any) -> str:
    return json.dumps(value, allow_nan=True)


# --- profile.json --------------------------------------------------------------------------------------------------


@FUZZ
@given(value=json_values)
def test_profile_from_random_json(value):
    only_our_errors(lambda: profile_from_data(value))


@FUZZ
@given(data=st.data())
def test_profile_from_mutated_documents(profile_doc, data):
    doc = data.draw(mutated([profile_doc]))
    only_our_errors(lambda: profile_from_data(doc))


def printable(show: Callable[[Any], None]) -> None:
    """What a loader accepted can be shown on a UTF-8 terminal (no unpaired surrogates, no markup errors)."""
    from rich.console import Console

    buffer = io.StringIO()
    show(Console(file=buffer, width=100, highlight=False))
    buffer.getvalue().encode("utf-8")


def shown_profile(path: Path) -> None:
    from planner.profiler.show import render_profile

    profile = load_profile(path)
    printable(lambda console: render_profile(profile, console))


@FEW
@given(data=st.data())
def test_profile_file_with_garbled_text(profile_doc, scratch, data):
    path = scratch / "profile.json"
    path.write_text(data.draw(garbled([json.dumps(profile_doc, indent=1)])), errors="surrogatepass")
    only_our_errors(lambda: shown_profile(path))


@FEW
@given(data=st.data())
def test_profile_file_of_mutated_documents(profile_doc, scratch, data):
    """Mutated documents through the file path: escapes such as \\ud800 arrive as JSON text, as from a user."""
    path = scratch / "profile-mutated.json"
    path.write_text(_dump(data.draw(mutated([profile_doc]))))
    only_our_errors(lambda: shown_profile(path))


# --- plan.json -----------------------------------------------------------------------------------------------------


@FUZZ
@given(value=json_values)
def test_plan_from_random_json(value):
    only_our_errors(lambda: plan_from_data(value))


@FUZZ
@given(data=st.data())
def test_plan_from_mutated_documents(plan_docs, profile, data):
    doc = data.draw(mutated(plan_docs))
    with_profile = data.draw(st.booleans())
    only_our_errors(lambda: plan_from_data(doc, profile=profile if with_profile else None))


def shown_plan(path: Path, profile) -> None:
    from planner.commands.report import layout_text
    from plans.serial import dumps

    plan = load_plan(path, profile=profile)
    dumps(plan)
    printable(lambda console: console.print(f"{plan.profile.model} on {plan.cluster.name}:\n{layout_text(plan)}", markup=False))


@FEW
@given(data=st.data())
def test_plan_file_with_garbled_text(plan_docs, profile, scratch, data):
    path = scratch / "plan.json"
    path.write_text(data.draw(garbled([json.dumps(d, indent=1) for d in plan_docs])), errors="surrogatepass")
    only_our_errors(lambda: shown_plan(path, profile))


@FEW
@given(data=st.data())
def test_plan_file_of_mutated_documents(plan_docs, scratch, data):
    path = scratch / "plan-mutated.json"
    path.write_text(_dump(data.draw(mutated(plan_docs))))
    only_our_errors(lambda: shown_plan(path, None))


# --- a run's metrics log (mmplan compare --measured) -----------------------------------------------------------

METRICS_ROWS = [{"step": s, "loss": 2.0 - s / 10, "step_time_s": 0.1 if s == 0 else 0.02, "compute_s": [0.01, 0.012],
                 "comm_s": [0.002, 0.001], "idle_s": [0.008, 0.007], "peak_memory_bytes": [2e8, 1.5e8]} for s in range(3)]


@FUZZ
@given(data=st.data())
def test_metrics_log_mutated_and_garbled(scratch, data):
    from planner.commands.compare import read_metrics

    rows = [data.draw(mutated([row], max_mutations=2)) if data.draw(st.booleans()) else row for row in METRICS_ROWS]
    text = "".join(_dump(r) + "\n" for r in rows)
    if data.draw(st.booleans()):
        text = data.draw(garbled([text]))
    path = scratch / "run.jsonl"
    path.write_text(text, errors="surrogatepass")
    only_our_errors(lambda: read_metrics(path))


# --- cluster TOML and shorthand --------------------------------------------------------------------------------


def _toml_value(value: Any) -> str:
    """A TOML value (tables inline) -- enough to write back any document tomllib reads."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int,)):
        return str(value)
    if isinstance(value, float):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf") if math.isinf(value) else repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string of printable escapes is a TOML basic string
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(str(k))} = {_toml_value(v)}" for k, v in value.items()) + "}"
    if value is None:
        return '""'  # TOML has no null
    return json.dumps(str(value))


def _toml(doc: dict) -> str:
    return "".join(f"{json.dumps(str(k))} = {_toml_value(v)}\n" for k, v in doc.items())


@pytest.fixture(scope="module")
def cluster_docs() -> list[dict]:
    import tomllib

    return [tomllib.loads(text) for text in CLUSTER_TOMLS]


def test_toml_writer_round_trips(cluster_docs):
    for text, doc in zip(CLUSTER_TOMLS, cluster_docs):
        assert cluster_from_toml(_toml(doc)) == cluster_from_toml(text)


@FUZZ
@given(text=st.text(max_size=80) | st.text(alphabet=st.sampled_from(list("[]{}=\".,#\n abcdeg_0123456789")), max_size=80))
def test_cluster_from_random_toml_text(text):
    only_our_errors(lambda: cluster_from_toml(text))


@FUZZ
@given(data=st.data())
def test_cluster_from_mutated_toml(cluster_docs, data):
    doc = data.draw(mutated(cluster_docs))
    text = _toml(doc) if isinstance(doc, dict) else f"value = {_toml_value(doc)}\n"
    only_our_errors(lambda: cluster_from_toml(text))


@FEW
@given(data=st.data())
def test_cluster_file_with_garbled_text(scratch, data):
    path = scratch / "cluster.toml"
    path.write_text(data.draw(garbled(CLUSTER_TOMLS)), errors="surrogatepass")
    only_our_errors(lambda: load_cluster_toml(path))


@FUZZ
@given(spec=st.text(max_size=24) | st.from_regex(r"-?[0-9]{0,25}\s*x?\s*[a-z0-9._-]{0,12}", fullmatch=True),
       gpus_per_node=st.none() | st.integers(-3, 20) | st.sampled_from([True, 2.5, "8"]))
def test_cluster_shorthand(spec, gpus_per_node, monkeypatch_module_cwd):
    only_our_errors(lambda: parse_cluster(spec, gpus_per_node))


@pytest.fixture(scope="module")
def monkeypatch_module_cwd(scratch):
    """Random cluster specs may name relative paths: resolve them in an empty directory."""
    import os

    previous = os.getcwd()
    empty = scratch / "cwd"
    empty.mkdir()
    os.chdir(empty)
    yield
    os.chdir(previous)


# --- architecture TOML (mmplan profile model.toml) -----------------------------------------------------------------


@pytest.fixture(scope="module")
def arch_docs() -> list[dict]:
    import tomllib

    return [tomllib.loads(p.read_text()) for p in sorted(ARCH_EXAMPLES.glob("*.toml"))]


@FUZZ
@given(data=st.data())
def test_architecture_toml_mutated(arch_docs, scratch, data):
    from runtime.source import resolve

    doc = data.draw(mutated(arch_docs))
    path = scratch / "model.toml"
    path.write_text(_toml(doc) if isinstance(doc, dict) else f"value = {_toml_value(doc)}\n")
    only_our_errors(lambda: resolve(str(path)))


@FEW
@given(data=st.data())
def test_architecture_toml_garbled(scratch, data):
    from runtime.source import resolve

    path = scratch / "garbled.toml"
    path.write_text(data.draw(garbled([p.read_text() for p in sorted(ARCH_EXAMPLES.glob("*.toml"))])),
                    errors="surrogatepass")
    only_our_errors(lambda: resolve(str(path)))


# --- inputs no random search is likely to build ------------------------------------------------------------------

DEEP_JSON = "[" * 100_000
HUGE_INT = "1" * 5000  # past Python's int-from-string digit limit


@pytest.mark.parametrize("text", [DEEP_JSON, "[" * 5000 + "]" * 5000, HUGE_INT, '{"schema": ' + HUGE_INT + "}",
                                  "\ufeff{}", "NaN", "", "\x00", '{"model": "\\ud800"}'],
                         ids=["unclosed-deep", "deep", "huge-int", "huge-int-field", "bom", "nan", "empty", "nul",
                              "lone-surrogate"])
def test_json_loaders_on_pathological_text(scratch, text):
    from planner.commands.compare import read_metrics

    path = scratch / "pathological.json"
    path.write_text(text)
    only_our_errors(lambda: load_profile(path))
    only_our_errors(lambda: load_plan(path))
    only_our_errors(lambda: read_metrics(path))


def test_a_profile_with_an_unpaired_surrogate_is_refused(profile_doc, scratch):
    path = scratch / "surrogate.json"
    path.write_text(json.dumps({**profile_doc, "model": "tiny\ud800"}))  # json.dumps writes the escape \ud800
    with pytest.raises(MmplanError, match="surrogate"):
        load_profile(path)
    path.write_text(json.dumps({**profile_doc, "model": "tiny \U0001F600"}))  # a pair of escapes is one character
    assert load_profile(path).model == "tiny \U0001F600"


@pytest.mark.parametrize("text", ["a = " + "[" * 5000 + "]" * 5000, "a = " + "{b = " * 3000 + "1" + "}" * 3000,
                                  "nodes = " + HUGE_INT, 'base = "h100-sxm"\n[links.nvme]\nlatency_us = 1e400',
                                  'base = "h100-sxm"\n[device]\nmemory_bandwidth_gbps = 1e400',
                                  'base = "h100-sxm"\n[device]\nefficiency = [[1e-400, 0.5]]'],
                         ids=["deep-array", "deep-table", "huge-int", "latency-overflow", "bandwidth-overflow", "flops-underflow"])
def test_cluster_loader_on_pathological_text(text):
    only_our_errors(lambda: cluster_from_toml(text))


@pytest.mark.parametrize("path", ["nul\x00.json", "", ".", "x" * 5000 + ".toml"], ids=["nul", "empty", "dot", "too-long"])
def test_loaders_on_impossible_paths(path):
    only_our_errors(lambda: load_profile(path))
    only_our_errors(lambda: load_plan(path))
    only_our_errors(lambda: load_cluster_toml(path))
    only_our_errors(lambda: parse_cluster(path))


@pytest.mark.parametrize("spec", ["1" * 5000 + "xh100-sxm", "x" * 5000, "8xh100-sxm\x00", "a\x00.toml", "x" * 5000 + ".toml"],
                         ids=["huge-count", "too-long-name", "nul-name", "nul-path", "too-long-path"])
def test_cluster_shorthand_extremes(spec):
    only_our_errors(lambda: parse_cluster(spec))


@pytest.mark.parametrize("spec", ["x" * 5000 + ".toml", "a\x00.toml", "x" * 5000, "no_such_module_xyz:factory", ":", "a:b:c"],
                         ids=["too-long-path", "nul-path", "too-long-name", "missing-module", "colon", "two-colons"])
def test_model_spec_extremes(spec):
    from runtime.source import resolve

    only_our_errors(lambda: resolve(spec))

"""The bad-input corpus: every command given a wrong input answers with one line on stderr and exit code 2.

Each case asserts: exit code 2; exactly one non-empty line on stderr, `error: ...`, containing a word that names
the problem; no traceback anywhere; and nothing left behind -- no output file, no stray `.tmp`, no directory,
neither in the case's own directory nor next to the shared input files.
"""
from __future__ import annotations

import json
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pytest
from typer.testing import CliRunner

from planner.cli import app

EXAMPLES = Path(__file__).resolve().parents[1] / "plans" / "examples"
USER_MODULE = "mmplan_bad_input_models"
runner = CliRunner()


@dataclass
class Case:
    args: list
    needle: str  # a word of the one error line that names the problem
    env: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Inputs:
    """Valid inputs shared by all cases (never modified), and the case's own empty working directory."""

    shared: Path
    tmp: Path

    @property
    def profile(self) -> Path:
        return self.shared / "tiny-vlm.json"

    @property
    def plan(self) -> Path:
        return self.shared / "tiny-vlm-pp2.json"

    def write(self, name: str, text: str | bytes) -> Path:
        path = self.tmp / name
        path.write_bytes(text) if isinstance(text, bytes) else path.write_text(text)
        return path

    def plan_with(self, name: str, change: Callable[[dict], None]) -> Path:
        doc = json.loads(self.plan.read_text())
        change(doc)
        return self.write(name, json.dumps(doc))

    def a_file(self) -> Path:
        return self.write("a_file", "not a directory\n")

    def solve(self, *args) -> list:
        return ["solve", self.profile, "-o", self.tmp / "plan.json", *args]

    def run(self, plan: Path | None = None, *args) -> list:
        return ["run", plan or self.plan, "--steps", "1", *args]


def _set(path: str, value) -> Callable[[dict], None]:
    """A change to a plan document: set the field at a slash path (list indices as numbers)."""
    *parents, last = [int(p) if p.isdigit() else p for p in path.split("/")]

    def change(doc: dict) -> None:
        for key in parents:
            doc = doc[key]
        doc[last] = value

    return change


# --- the corpus: name -> case, built in the case's own directory -------------------------------------------------

CASES: dict[str, Callable[[Inputs], Case]] = {
    # profile
    "profile: unknown zoo name": lambda x: Case(["profile", "no-such-model", "-o", x.tmp / "p.json"], "unknown model"),
    "profile: a factory that raises": lambda x: Case(["profile", f"{USER_MODULE}:raises", "-o", x.tmp / "p.json"], "raised"),
    "profile: truncated architecture TOML": lambda x: Case(
        ["profile", x.write("model.toml", "[vision]\nimage_size = 32\npatch = "), "-o", x.tmp / "p.json"], "Invalid value"),
    "profile: negative size in an architecture TOML": lambda x: Case(
        ["profile", x.write("model.toml", "[decoder]\ntype = 'llama'\nhidden = -8\nlayers = 1\nheads = 2\nvocab = 10\n"
                                          "text_seq = 4\n"), "-o", x.tmp / "p.json"], "hidden"),
    "profile: architecture TOML that is a directory": lambda x: Case(
        ["profile", _mkdir(x.tmp / "model.toml"), "-o", x.tmp / "p.json"], "directory"),
    "profile: negative micro-batch": lambda x: Case(["profile", "tiny-vlm", "--micro-batch", "-1", "-o", x.tmp / "p.json"],
                                                    "--micro-batch"),
    "profile: unknown dtype": lambda x: Case(["profile", "tiny-vlm", "--dtype", "fp4", "-o", x.tmp / "p.json"], "dtype"),
    "profile: output under a regular file": lambda x: Case(["profile", "tiny-vlm", "-o", x.a_file() / "p.json"],
                                                           "cannot write"),
    "profile: output is a directory": lambda x: Case(["profile", "tiny-vlm", "-o", x.tmp], "is a directory"),
    "profile: output file name too long": lambda x: Case(["profile", "tiny-vlm", "-o", x.tmp / ("p" * 250)], "too long"),
    # show
    "show: truncated profile": lambda x: Case(["show", x.write("p.json", x.profile.read_text()[:300])], "not valid JSON"),
    "show: profile of another schema version": lambda x: Case(
        ["show", x.write("p.json", x.profile.read_text().replace("mmplan.profile/2", "mmplan.profile/3"))], "schema"),
    "show: a plan given as profile": lambda x: Case(["show", x.plan], "mmplan.plan/3"),
    "show: profile whose blocks were edited": lambda x: Case(["show", x.write("p.json", _edit_params(x.profile.read_text()))],
                                                             "fingerprint"),
    "show: a block timed forward only": lambda x: Case(["show", x.write("p.json", _forward_only(x.profile.read_text()))],
                                                       "no backward"),
    "show: binary file": lambda x: Case(["show", x.write("p.json", b"\xff\xfe\x00\x81garbage")], "UTF-8"),
    "show: nesting too deep for JSON": lambda x: Case(["show", x.write("p.json", "[" * 100_000)], "nest"),
    "show: missing profile": lambda x: Case(["show", x.tmp / "missing.json"], "cannot read"),
    "show: negative --top": lambda x: Case(["show", x.profile, "--top", "-1"], "--top"),
    # solve
    "solve: zero GPUs": lambda x: Case(x.solve("--cluster", "0xh100-sxm", "--global-batch", "8"), "GPU count"),
    "solve: unknown catalog device": lambda x: Case(x.solve("--cluster", "8xtpu-v5", "--global-batch", "8"), "unknown device"),
    "solve: negative host memory in a cluster TOML": lambda x: Case(
        x.solve("--cluster", x.write("c.toml", 'base = "local-cpu"\nhost_memory_gb = -4\n'), "--global-batch", "8"),
        "host_memory_gb"),
    "solve: truncated cluster TOML": lambda x: Case(
        x.solve("--cluster", x.write("c.toml", 'base = "h100-sxm"\n[device\nmemory_gb = 8'), "--global-batch", "8"),
        "not valid TOML"),
    "solve: cluster TOML out of range": lambda x: Case(
        x.solve("--cluster", x.write("c.toml", 'base = "h100-sxm"\n[links.nvme]\nlatency_us = 1e999\n'), "--global-batch", "8"),
        "out of range"),
    "solve: missing cluster TOML": lambda x: Case(x.solve("--cluster", x.tmp / "nope.toml", "--global-batch", "8"), "not found"),
    "solve: zero global batch": lambda x: Case(x.solve("--cluster", "2xlocal-cpu", "--global-batch", "0"), "--global-batch"),
    "solve: negative micro-batch": lambda x: Case(
        x.solve("--cluster", "2xlocal-cpu", "--global-batch", "8", "--micro-batch", "-1"), "micro-batch"),
    "solve: layout larger than the cluster": lambda x: Case(
        x.solve("--cluster", "2xlocal-cpu", "--global-batch", "8", "--baseline", "homogeneous", "--layout", "tp=1,pp=1,dp=8"),
        "GPUs"),
    "solve: global batch smaller than the data-parallel width": lambda x: Case(
        x.solve("--cluster", "4xlocal-cpu", "--global-batch", "2", "--baseline", "homogeneous", "--layout", "tp=1,pp=1,dp=4"),
        "global batch"),
    "solve: model that cannot fit even with every tier": lambda x: Case(
        ["solve", x.shared / "llava-1.5-7b.json", "-o", x.tmp / "plan.json", "--global-batch", "8", "--cluster",
         x.write("c.toml", 'base = "a100-40g"\nnodes = 1\ngpus_per_node = 1\nhost_memory_gb = 1\nnvme_gb = 1\n')],
        "cannot fit"),
    "solve: nodes that do not divide the GPUs": lambda x: Case(
        x.solve("--cluster", "4xlocal-cpu", "--global-batch", "8", "--gpus-per-node", "3"), "whole nodes"),
    "solve: --layout without --baseline": lambda x: Case(
        x.solve("--cluster", "2xlocal-cpu", "--global-batch", "8", "--layout", "tp=1,pp=2,dp=1"), "--baseline"),
    "solve: output in a missing directory": lambda x: Case(
        ["solve", x.profile, "--cluster", "2xlocal-cpu", "--global-batch", "8", "-o", x.tmp / "no" / "plan.json"],
        "does not exist"),
    "solve: a plan given as profile": lambda x: Case(
        ["solve", x.plan, "-o", x.tmp / "plan.json", "--cluster", "2xlocal-cpu", "--global-batch", "8"], "schema"),
    "solve: --from megatron with a layout of unknown layers": lambda x: Case(
        x.solve("--cluster", "2xlocal-cpu", "--global-batch", "8", "--from", "megatron",
                "--pipeline-model-parallel-size 2 --pipeline-model-parallel-layout Ex|tL"), "unknown characters"),
    "solve: --from megatron degrees that do not divide the cluster": lambda x: Case(
        x.solve("--cluster", "2xlocal-cpu", "--global-batch", "8", "--from", "megatron", "--tensor-model-parallel-size 3"),
        "does not divide"),
    "solve: --from megatron with context parallelism": lambda x: Case(
        x.solve("--cluster", "2xlocal-cpu", "--global-batch", "8", "--from", "megatron", "--context-parallel-size 2"),
        "context parallelism"),
    "solve: --from megatron with an unterminated quote": lambda x: Case(
        x.solve("--cluster", "2xlocal-cpu", "--global-batch", "8", "--from", "megatron", "--pipeline-model-parallel-layout 'Et"),
        "cannot split"),
    "solve: --from megatron of a missing argument file": lambda x: Case(
        x.solve("--cluster", "2xlocal-cpu", "--global-batch", "8", "--from", "megatron", f"@{x.tmp / 'none.args'}"), "cannot read"),
    "solve: --from deepspeed of a missing file": lambda x: Case(
        x.solve("--cluster", "2xlocal-cpu", "--global-batch", "8", "--from", "deepspeed", x.tmp / "ds.json"), "cannot read"),
    "solve: --from deepspeed batch sizes that do not multiply out": lambda x: Case(
        x.solve("--cluster", "2xlocal-cpu", "--global-batch", "8", "--from", "deepspeed", x.write("ds.json", json.dumps(
            {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 1}))), "train_batch_size"),
    "solve: --from deepspeed truncated": lambda x: Case(
        x.solve("--cluster", "2xlocal-cpu", "--global-batch", "8", "--from", "deepspeed", x.write("ds.json", '{"train_batch')),
        "not valid JSON"),
    "solve: --from with another baseline": lambda x: Case(
        x.solve("--cluster", "2xlocal-cpu", "--global-batch", "8", "--baseline", "zero3", "--from", "megatron", ""), "--from"),
    "solve: --from an unknown framework": lambda x: Case(
        x.solve("--cluster", "2xlocal-cpu", "--global-batch", "8", "--from", "nemo", "x"), "choose one of"),
    # export
    "export: a target that does not exist": lambda x: Case(["export", x.plan, "--to", "nemo", "-o", x.tmp / "out"],
                                                           "unknown export target"),
    "export: a feature the target cannot express": lambda x: Case(
        ["export", x.plan, "--to", "deepspeed", "-o", x.tmp / "ds.json"], "cannot express"),
    "export: output in a missing directory": lambda x: Case(
        ["export", x.plan, "--to", "megatron", "-o", x.tmp / "no" / "m.args"], "does not exist"),
    "export: output is a directory": lambda x: Case(["export", x.plan, "--to", "megatron", "-o", x.tmp], "is a directory"),
    "export: truncated plan": lambda x: Case(["export", x.write("plan.json", x.plan.read_text()[:-60]), "--to", "torchtitan"],
                                             "not valid JSON"),
    "export: missing plan": lambda x: Case(["export", x.tmp / "missing.json", "--to", "megatron-bridge"], "cannot read"),
    # run
    "run: plan for another model": lambda x: Case(x.run(None, "--model", "tiny-avlm"), "fingerprint"),
    "run: plan naming an unknown model": lambda x: Case(
        x.run(x.plan_with("plan.json", _set("profile/model", "no-such-model"))), "unknown model"),
    "run: ranks do not match the launch": lambda x: Case(x.run(), "launched with 3", env={
        "WORLD_SIZE": "3", "RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "j"}),
    "run: a stray WORLD_SIZE without torchrun": lambda x: Case(x.run(), "WORLD_SIZE=3", env={"WORLD_SIZE": "3"}),
    "run: WORLD_SIZE that is not a number": lambda x: Case(x.run(), "WORLD_SIZE", env={"WORLD_SIZE": "two"}),
    "run: ZeRO with tiers FSDP2 cannot hold": lambda x: Case(x.run(x.plan_with("plan.json", lambda d: (
        _set("groups/0/zero", 1)(d), _set("groups/0/stages/0/memory", {"params": "nvme"})(d)))), "ZeRO stage 1"),
    "run: interleaved schedule without virtual stages": lambda x: Case(
        x.run(x.plan_with("plan.json", _set("training/schedule", "interleaved"))), "virtual_stages >= 2"),
    "run: zero steps": lambda x: Case(["run", x.plan, "--steps", "0"], "--steps"),
    "run: negative device budget": lambda x: Case(x.run(None, "--device-budget", "-1"), "--device-budget"),
    "run: zero global batch in the plan": lambda x: Case(
        x.run(x.plan_with("plan.json", _set("training/global_batch", 0))), "global_batch"),
    "run: rank outside the cluster": lambda x: Case(
        x.run(x.plan_with("plan.json", _set("groups/0/stages/0/ranks", [9]))), "out of range"),
    "run: plan of another schema version": lambda x: Case(
        x.run(x.plan_with("plan.json", _set("schema", "mmplan.plan/0"))), "schema"),
    "run: truncated plan": lambda x: Case(x.run(x.write("plan.json", x.plan.read_text()[:-60])), "not valid JSON"),
    "run: plan with a field of the wrong type": lambda x: Case(
        x.run(x.plan_with("plan.json", _set("groups/0/dp", "two"))), "dp"),
    "run: nvme tier without --nvme-dir": lambda x: Case(
        x.run(x.plan_with("plan.json", _set("groups/0/stages/0/memory", {"params": "nvme"}))), "--nvme-dir"),
    "run: --nvme-dir under a regular file": lambda x: Case(
        x.run(x.plan_with("plan.json", _set("groups/0/stages/0/memory", {"params": "nvme"})), "--nvme-dir",
              x.a_file() / "nvme"), "--nvme-dir"),
    "run: --checkpoint-dir under a regular file": lambda x: Case(
        x.run(None, "--checkpoint-every", "1", "--checkpoint-dir", x.a_file() / "ckpt"), "--checkpoint-dir"),
    "run: --checkpoint-every without a directory": lambda x: Case(x.run(None, "--checkpoint-every", "1"), "--checkpoint-dir"),
    "run: --resume from a missing directory": lambda x: Case(x.run(None, "--resume", x.tmp / "no-ckpt"), "--resume"),
    "run: --log under a regular file": lambda x: Case(x.run(None, "--log", x.a_file() / "run.jsonl"), "cannot write"),
    "run: --log is a directory": lambda x: Case(x.run(None, "--log", x.tmp), "is a directory"),
    "run: --checkpoint-dir name too long": lambda x: Case(
        x.run(None, "--checkpoint-every", "1", "--checkpoint-dir", x.tmp / ("c" * 300)), "too long"),
    "run: --profile of another model": lambda x: Case(x.run(None, "--profile", x.shared / "llava-1.5-7b.json"),
                                                      "another model"),
    "run: a dataset factory that raises": lambda x: Case(
        x.run(None, "--data", f"{USER_MODULE}:dataset_raises", "--log", x.tmp / "run.jsonl",
              "--checkpoint-every", "1", "--checkpoint-dir", x.tmp / "ckpt"), "dataset factory"),
    "run: a device budget too small for the plan": lambda x: Case(
        x.run(None, "--device-budget", "1000", "--log", x.tmp / "run.jsonl", "--checkpoint-every", "1",
              "--checkpoint-dir", x.tmp / "ckpt" / "nested"), "budget"),
    # compare
    "compare: truncated plan": lambda x: Case(["compare", x.write("plan.json", x.plan.read_text()[:-60])], "not valid JSON"),
    "compare: profile of another model": lambda x: Case(
        ["compare", x.plan, "--profile", x.shared / "llava-1.5-7b.json"], "another model"),
    "compare: --trace under a regular file": lambda x: Case(
        ["compare", x.plan, "--profile", x.profile, "--trace", x.a_file() / "traces"], "trace directory"),
    "compare: --trace name too long": lambda x: Case(
        ["compare", x.plan, "--profile", x.profile, "--trace", x.tmp / ("t" * 300)], "too long"),
    "compare: missing --measured log": lambda x: Case(["compare", x.plan, "--measured", x.tmp / "run.jsonl"], "metrics log"),
    "compare: --measured log of the wrong shape": lambda x: Case(
        ["compare", x.plan, "--measured", x.write("run.jsonl", "[1, 2]\n")], "metrics log"),
    # calibrate
    "calibrate: one rank": lambda x: Case(["calibrate", "--quick", "--ranks", "1", "-o", x.tmp / "c.toml"], "ranks"),
    "calibrate: output is a directory": lambda x: Case(["calibrate", "--quick", "-o", x.tmp], "is a directory"),
    "calibrate: output in a missing directory": lambda x: Case(
        ["calibrate", "--quick", "-o", x.tmp / "no" / "c.toml"], "does not exist"),
    # demo
    "demo: output is a file": lambda x: Case(["demo", "-o", x.a_file()], "is a file"),
    "demo: output under a regular file": lambda x: Case(["demo", "-o", x.a_file() / "demo"], "cannot create"),
    "demo: output name too long": lambda x: Case(["demo", "-o", x.tmp / ("d" * 300)], "too long"),
    "demo: unknown model": lambda x: Case(["demo", "-o", x.tmp / "demo", "--model", "no-such-model"], "unknown model"),
    "demo: a factory that raises": lambda x: Case(["demo", "-o", x.tmp / "demo", "--model", f"{USER_MODULE}:raises"], "raised"),
    "demo: zero GPUs": lambda x: Case(["demo", "-o", x.tmp / "demo", "--cluster", "0xlocal-cpu"], "GPU count"),
    "demo: zero global batch": lambda x: Case(["demo", "-o", x.tmp / "demo", "--global-batch", "0"], "--global-batch"),
    "demo: zero steps": lambda x: Case(["demo", "-o", x.tmp / "demo", "--steps", "0"], "--steps"),
}


def _mkdir(path: Path) -> Path:
    path.mkdir()
    return path


def _edit_params(text: str) -> str:
    """A profile with one block's structure (class, parameter shapes) changed by hand: its fingerprint no longer matches."""
    doc = json.loads(text)
    doc["blocks"][0]["structure"] = "0" * 12
    return json.dumps(doc)


def _forward_only(text: str) -> str:
    """A profile with one block's forward time measured and its backward time not (hypothesis found `show` crashing
    on one)."""
    doc = json.loads(text)
    doc["blocks"][0].update(fwd_ms=1.5, bwd_ms=None)
    return json.dumps(doc)


USER_MODELS = textwrap.dedent("""
    def raises(micro_batch=1):
        raise RuntimeError("no weights here")

    def dataset_raises(*args, **kwargs):
        raise RuntimeError("no data here")
""")


@pytest.fixture(scope="module")
def shared(tmp_path_factory) -> Path:
    from cost_models.cluster_spec import parse_cluster  # noqa: F401  (import cost outside the timed cases)
    from planner.profiler.profile import profile_model
    from plans.graph import save_profile
    from runtime.source import resolve

    d = tmp_path_factory.mktemp("bad-inputs")
    save_profile(profile_model(resolve("tiny-vlm")), d / "tiny-vlm.json")
    save_profile(profile_model(resolve("llava-1.5-7b")), d / "llava-1.5-7b.json")  # 7 B params: ~112 GB of training state
    (d / "tiny-vlm-pp2.json").write_text((EXAMPLES / "tiny-vlm-pp2.json").read_text())
    (d / f"{USER_MODULE}.py").write_text(USER_MODELS)
    return d


def tree(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


def test_the_corpus_is_large_and_spans_every_command():
    commands = {name.split(":")[0] for name in CASES}
    assert len(CASES) >= 30
    assert commands == {"profile", "show", "solve", "run", "compare", "calibrate", "demo", "export"}


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_gives_one_line_exit_2_and_leaves_nothing(name, shared, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(shared))
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    case = CASES[name](Inputs(shared, tmp_path))
    before, shared_before = tree(tmp_path), tree(shared)
    try:
        res = runner.invoke(app, [str(a) for a in case.args], env=case.env or None)
    finally:
        sys.modules.pop(USER_MODULE, None)
    assert "Traceback" not in res.output + res.stderr, (name, res.stderr)
    assert res.exception is None or isinstance(res.exception, SystemExit), (name, repr(res.exception))
    assert res.exit_code == 2, (name, res.exit_code, res.output, res.stderr)
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, (name, res.stderr)
    assert lines[0].startswith("error: ") and len(lines[0]) > len("error: ") + 10, (name, lines[0])
    assert case.needle in lines[0], (name, case.needle, lines[0])
    assert tree(tmp_path) == before, (name, "left behind", sorted(tree(tmp_path) - before))
    assert tree(shared) == shared_before, (name, "left behind", sorted(tree(shared) - shared_before))
    assert not list(tmp_path.rglob("*.tmp")) and not list(tmp_path.rglob(".*.tmp-*")), name
    assert not list(tmp_path.rglob(".mmplan-probe-*")), name

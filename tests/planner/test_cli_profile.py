"""`mmplan profile` and `mmplan show` from the command line: output files, help, one-line errors."""
from __future__ import annotations

import json
import sys
import textwrap

import pytest
from typer.testing import CliRunner

from planner.cli import app
from plans.graph import load_profile

runner = CliRunner()


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


def test_help_teaches():
    res = invoke("--help")
    assert res.exit_code == 0 and "profile" in res.output
    res = invoke("profile", "--help")
    assert res.exit_code == 0 and "--micro-batch" in res.output and "package.module:factory" in res.output


def test_profile_writes_a_valid_profile_and_show_reads_it(tmp_path):
    out = tmp_path / "p.json"
    res = invoke("profile", "tiny-avlm", "-o", out, "--micro-batch", 2)
    assert res.exit_code == 0, res.output
    prof = load_profile(out)
    assert prof.model == "tiny-avlm" and prof.micro_batch == 2
    res = invoke("show", out)
    assert res.exit_code == 0 and "vision" in res.output and "audio_proj" in res.output


def test_profile_json_summary(tmp_path):
    out = tmp_path / "p.json"
    res = invoke("profile", "tiny-vlm", "-o", out, "--json")
    assert res.exit_code == 0
    summary = json.loads(res.stdout)
    assert summary["profile"] == str(out) and summary["blocks"] == len(load_profile(out).blocks)


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "usermodels.py").write_text(textwrap.dedent("""
        import torch
        from torch import nn

        class Tiny(nn.Module):
            def __init__(self):
                super().__init__()
                self.embed = nn.Linear(4, 8)
                self.layers = nn.ModuleList([nn.Linear(8, 8) for _ in range(3)])
            def forward(self, x):
                x = self.embed(x)
                for layer in self.layers:
                    x = torch.relu(layer(x))
                return x.pow(2).mean()

        def factory(micro_batch=1):
            return Tiny(), {"x": torch.randn(micro_batch, 4)}

        def raises(micro_batch=1):
            raise RuntimeError("no weights here")

        def wrong(micro_batch=1):
            return 42

        def noblocks(micro_batch=1):
            return nn.Linear(2, 2), {"input": torch.randn(1, 2)}
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "usermodels"
    sys.modules.pop("usermodels", None)


def test_profile_a_users_factory(tmp_path, user_module):
    out = tmp_path / "p.json"
    res = invoke("profile", f"{user_module}:factory", "-o", out)
    assert res.exit_code == 0, res.output
    prof = load_profile(out)
    assert [b.name for b in prof.blocks] == ["embed", "layers.0", "layers.1", "layers.2"]
    assert [(e.src, e.dst) for e in prof.edges] == [("embed", "layers.0"), ("layers.0", "layers.1"), ("layers.1", "layers.2")]


def bad_inputs(tmp_path, user_module):
    malformed = tmp_path / "bad.toml"
    malformed.write_text("[decoder\ntype = 'llama'")
    unknown_key = tmp_path / "unknown.toml"
    unknown_key.write_text("[decoder]\ntype='llama'\nhidden=8\nlayers=1\nheads=2\nvocab=10\ntext_seq=4\nwings=2\n")
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    return {
        "unknown zoo name": (["profile", "no-such-model"], "known zoo models"),
        "unimportable factory": (["profile", "no_such_pkg.mod:factory"], "cannot import"),
        "missing factory attribute": (["profile", f"{user_module}:nope"], "no callable"),
        "factory that raises": (["profile", f"{user_module}:raises"], "no weights here"),
        "factory returning junk": (["profile", f"{user_module}:wrong"], "must return"),
        "model without layer containers": (["profile", f"{user_module}:noblocks"], "ModuleList"),
        "malformed TOML": (["profile", str(malformed)], str(malformed)),
        "TOML with unknown key": (["profile", str(unknown_key)], "wings"),
        "missing TOML": (["profile", str(tmp_path / "nope.toml")], "does not exist"),
        "zero micro-batch": (["profile", "tiny-vlm", "--micro-batch", "0"], "micro-batch"),
        "unknown device": (["profile", "tiny-vlm", "--device", "tpu"], "--device"),
        "measure on meta": (["profile", "tiny-vlm", "--measure"], "--measure"),
        "unknown dtype": (["profile", "tiny-vlm", "--dtype", "fp8"], "dtype"),
        "bad group override": (["profile", "tiny-vlm", "--group", "llm.head"], "PATTERN=GROUP"),
        "output under a file": (["profile", "tiny-vlm", "-o", str(a_file / "p.json")], "cannot write"),
        "output is a directory": (["profile", "tiny-vlm", "-o", str(tmp_path)], "is a directory"),
        "missing output dir": (["profile", "tiny-vlm", "-o", str(tmp_path / "no" / "p.json")], "does not exist"),
        "show a missing profile": (["show", str(tmp_path / "missing.json")], "cannot read"),
        "show a non-JSON profile": (["show", str(malformed)], "not valid JSON"),
    }


def test_bad_inputs_give_one_line_exit_2_and_no_file(tmp_path, user_module, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for case, (args, needle) in bad_inputs(tmp_path, user_module).items():
        out = tmp_path / "out.json"
        if args[0] == "profile" and "-o" not in args:
            args = [*args, "-o", str(out)]
        res = runner.invoke(app, args)
        assert res.exit_code == 2, (case, res.output)
        assert "Traceback" not in res.output, case
        lines = [l for l in res.stderr.splitlines() if l.strip()]
        assert len(lines) == 1 and needle in lines[0], (case, res.stderr)
        assert not out.exists(), case
        assert not list(tmp_path.glob("**/.*.tmp")), case


def test_profile_kernels_fused_counts_the_layers_per_op(tmp_path):
    from cost_models.fused import fused_layer_bytes, is_layer_of

    eager, fused = tmp_path / "e.json", tmp_path / "f.json"
    assert invoke("profile", "tiny-vlm", "-o", eager, "-q").exit_code == 0
    res = invoke("profile", "tiny-vlm", "-o", fused, "-q", "--kernels", "fused")
    assert res.exit_code == 0, res.output
    e, f = load_profile(eager), load_profile(fused)
    assert e.kernels == "eager" and f.kernels == "fused" and f.fingerprint == e.fingerprint
    shapes = {s.group: s for s in f.shapes}
    layers = [b for b in f.blocks if b.group in shapes and is_layer_of(b, shapes[b.group])]
    assert layers  # the zoo model's transformer layers are recognised
    for b in layers:
        assert b.activation_bytes == fused_layer_bytes(shapes[b.group], f.dtype, dropout=shapes[b.group].dropout).total * (
            b.sequence or shapes[b.group].sequence)
    res = invoke("profile", "tiny-vlm", "-o", tmp_path / "x.json", "--kernels", "tensorrt")
    assert res.exit_code == 2 and "--kernels must be one of eager, fused" in res.output
    assert not (tmp_path / "x.json").exists()

"""bench/gpu_check.py: without CUDA it says so and exits 0; its CPU dry run goes through every row (slow:
`pytest tests/test_gpu_check.py -m slow`, about 3-4 minutes on 2 cores)."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

PATH = Path(__file__).resolve().parents[1] / "bench" / "gpu_check.py"


def _module():
    spec = importlib.util.spec_from_file_location("gpu_check", PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_without_cuda_it_says_so_and_exits_cleanly(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert _module().main([]) == 0
    assert "no CUDA device here" in capsys.readouterr().out


@pytest.mark.slow
def test_the_cpu_dry_run_passes_every_row(capsys):
    code = _module().main(["--device", "cpu"])
    out = capsys.readouterr().out
    for name in ("profile --measure, real-size block", "CPU offload + prefetch", "offload overlap", "recompute (full)",
                 "ZeRO-3, world 1", "checkpoint + resume", "predicted vs measured step time", "predicted vs measured peak memory"):
        assert name in out
    assert code == 0 and "FAIL" not in out, out

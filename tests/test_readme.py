"""Every command in the README runs, in order, in a scratch copy of the repository."""
from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def bash_blocks(text: str) -> list[list[str]]:
    return [[line for line in block.splitlines() if line.strip() and not line.startswith("#")]
            for block in re.findall(r"```bash\n(.*?)```", text, re.S)]


def quickstart() -> list[str]:
    section = README.split("<!-- quickstart -->")[1].split("<!-- /quickstart -->")[0]
    return [line for block in bash_blocks(section) for line in block]


def guide_commands() -> list[str]:
    guide = README.split("## Guide")[1]
    guide = guide.split("<!-- hf -->")[0] + guide.split("<!-- /hf -->")[1]  # needs transformers: its own test
    return [line for block in bash_blocks(guide) for line in block]


def hf_commands() -> list[str]:
    section = README.split("<!-- hf -->")[1].split("<!-- /hf -->")[0]
    return [line for block in bash_blocks(section) for line in block]


@pytest.fixture(scope="module")
def scratch(tmp_path_factory) -> Path:
    """A copy of the repository, so commands that read its files (examples, TOMLs) find them."""
    dst = tmp_path_factory.mktemp("readme") / "repo"
    shutil.copytree(ROOT, dst, ignore=shutil.ignore_patterns(".git", "__pycache__", "*.egg-info", ".pytest_cache",
                                                             ".hypothesis", "mmplan-demo"))
    return dst


def run(command: str, cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(cwd)}
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        env.pop(var, None)
    return subprocess.run(shlex.split(command), cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def test_the_readme_has_two_quickstart_commands():
    assert quickstart() == ["mmplan demo", "python -m pytest"]


def test_quickstart_main_command_verbatim(scratch):
    res = run(quickstart()[0], scratch)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "speed-up" in res.stdout
    for name in ("profile.json", "plan.json", "homogeneous.json", "run-solved.jsonl", "run-homogeneous.jsonl"):
        assert (scratch / "mmplan-demo" / name).is_file(), name
    assert list((scratch / "mmplan-demo" / "traces").glob("*.json"))


@pytest.mark.slow
def test_quickstart_test_command_verbatim(scratch):
    """The whole suite inside the suite: slow, run with `python -m pytest -m slow`."""
    res = run(quickstart()[1] + " -x -q -p no:cacheprovider", scratch, timeout=1800)
    assert res.returncode == 0, res.stdout[-3000:]


def test_every_guide_command_runs_in_order(scratch):
    commands = guide_commands()
    assert len(commands) >= 15
    for command in commands:
        res = run(command, scratch)
        assert res.returncode == 0, f"{command}\n{res.stderr[-2000:]}"


@pytest.mark.slow  # 45 s; the default suite runs stock HF models from the CLI in tests/hf/test_hf_runtime.py
def test_every_hugging_face_command_runs_in_order(scratch):
    """The "Your Hugging Face model" section; needs transformers (pip install -e ".[hf]")."""
    pytest.importorskip("transformers")
    commands = hf_commands()
    assert len(commands) >= 8
    for command in commands:
        res = run(command, scratch)
        assert res.returncode == 0, f"{command}\n{res.stderr[-2000:]}"
    log = (scratch / "hf-run.jsonl").read_text().splitlines()
    assert len(log) == 20

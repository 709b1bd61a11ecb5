"""Every command in the README runs, in order, in an empty scratch directory (with $REPO and PYTHONPATH naming the
repository, as the Guide says), through bash, and leaves nothing in the repository."""
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
    """An empty directory: the Guide's commands find the repository's files through $REPO only."""
    return tmp_path_factory.mktemp("readme-guide")


@pytest.fixture(scope="module")
def repo_copy(tmp_path_factory) -> Path:
    """A copy of the repository, for the Quickstart's `python -m pytest` (run in a clone)."""
    dst = tmp_path_factory.mktemp("readme") / "repo"
    shutil.copytree(ROOT, dst, ignore=shutil.ignore_patterns(".git", "__pycache__", "*.egg-info", ".pytest_cache",
                                                             ".hypothesis", "mmplan-demo"))
    return dst


def run(command: str, cwd: Path, timeout: float = 600, repo: Path = ROOT) -> subprocess.CompletedProcess:
    """`command` through bash in `cwd`, with the Guide's REPO and PYTHONPATH (PYTHONDONTWRITEBYTECODE: the imports
    of examples.* leave no __pycache__ in the repository either)."""
    env = {**os.environ, "REPO": str(repo), "PYTHONPATH": str(repo), "PYTHONDONTWRITEBYTECODE": "1"}
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        env.pop(var, None)
    return subprocess.run(["bash", "-c", command], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def repo_files() -> set[str]:
    """Every file and directory under the repository (but .git and bytecode caches)."""
    found = set()
    for dirpath, dirnames, files in os.walk(ROOT):
        dirnames[:] = [d for d in dirnames if d not in (".git", "__pycache__", ".pytest_cache")]
        found.update(os.path.relpath(os.path.join(dirpath, f), ROOT) for f in files + dirnames)
    return found


def test_the_readme_has_two_quickstart_commands():
    assert quickstart() == ["mmplan demo", "python -m pytest"]


def test_quickstart_main_command_verbatim(scratch):
    res = run(quickstart()[0], scratch)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "speed-up" in res.stdout
    # the machine's speed before each round of runs against the profile's moment, in the verdict's panel
    panel = " ".join(res.stdout.replace("│", " ").split())
    assert re.search(r"timed alone before each round of runs: (\d+\.\d\dx, ){2}\d+\.\d\dx its time in the profile", panel), panel[-1500:]
    for name in ("profile.json", "plan.json", "homogeneous.json", "run-solved.jsonl", "run-homogeneous.jsonl"):
        assert (scratch / "mmplan-demo" / name).is_file(), name
    assert list((scratch / "mmplan-demo" / "traces").glob("*.json"))


@pytest.mark.slow
def test_quickstart_test_command_verbatim(repo_copy):
    """The whole suite inside the suite: slow, run with `python -m pytest -m slow`."""
    res = run(quickstart()[1] + " -x -q -p no:cacheprovider", repo_copy, timeout=1800, repo=repo_copy)
    assert res.returncode == 0, res.stdout[-3000:]


def test_every_guide_command_runs_in_order(scratch):
    commands = guide_commands()
    assert len(commands) >= 15
    before = repo_files()
    for command in commands:
        res = run(command, scratch)
        assert res.returncode == 0, f"{command}\n{res.stderr[-2000:]}"
    assert repo_files() == before  # the guide wrote nothing into the repository
    assert (scratch / "avlm.json").is_file() and (scratch / "ckpt").is_dir()  # but into its working directory


def test_the_guide_names_repository_files_through_repo():
    """A command that reads one of the repository's files names it under $REPO (a relative path would need the
    repository as the working directory)."""
    tracked = {p.relative_to(ROOT).as_posix() for p in ROOT.rglob("*") if ".git" not in p.parts}
    for command in guide_commands() + hf_commands():
        for word in shlex.split(command):
            path = word.split(":", 1)[1] if word.startswith("hf:") else word
            assert path.startswith("$REPO/") or path not in tracked, f"{command}: {path} is read from the working directory"


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


def install_commands() -> list[str]:
    section = README.split("## Quickstart")[1].split("<!-- quickstart -->")[0]
    return [line for block in bash_blocks(section) for line in block]


def test_the_install_makes_a_fresh_virtual_environment_and_names_the_cpu_wheel():
    commands = install_commands()
    assert commands[0].startswith("python3 -m venv .venv && . .venv/bin/activate")
    assert commands[-1] == 'pip install torch==2.13.0 && pip install -e ".[test]"'
    assert "pip install torch==2.13.0 --index-url" in README.split("## Quickstart")[1].split("## Guide")[0]


@pytest.mark.slow  # a torch install into a new environment: minutes and ~1 GB
def test_the_install_works_in_a_fresh_clone_and_virtual_environment(tmp_path):
    clone = tmp_path / "mmplan"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True, timeout=300)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    script = " && ".join([*install_commands(), "mmplan --version", "python -c 'import planner, runtime; print(runtime.__file__)'"])
    res = subprocess.run(["bash", "-c", script], cwd=clone, env=env, capture_output=True, text=True, timeout=1800)
    assert res.returncode == 0, res.stderr[-3000:]
    assert str(clone / "runtime") in res.stdout  # the clone's code, installed editable

"""torch's inductor cache directory, created in $TMPDIR by importing torch._dynamo, is not left behind empty."""
import os
import subprocess
import sys
from pathlib import Path

from planner.torch_cache import remove_if_empty

ROOT = Path(__file__).resolve().parents[2]


def test_profile_leaves_no_empty_inductor_directory(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    env.update(TMPDIR=str(tmp_path / "tmp"), PYTHONPATH=str(ROOT))
    (tmp_path / "tmp").mkdir()
    r = subprocess.run([sys.executable, "-m", "planner.cli", "profile", "tiny-vlm", "-o", str(tmp_path / "p.json"),
                        "--quiet"], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "p.json").exists() and list((tmp_path / "tmp").iterdir()) == []


def test_a_cached_file_and_its_directories_are_kept(tmp_path):
    cache = tmp_path / "torchinductor_me"
    (cache / "dynamo").mkdir(parents=True)
    (cache / "empty").mkdir()
    (cache / "dynamo" / "entry").write_text("cached")
    remove_if_empty(str(cache))
    assert (cache / "dynamo" / "entry").exists() and not (cache / "empty").exists()
    (cache / "dynamo" / "entry").unlink()
    remove_if_empty(str(cache))
    assert not cache.exists()

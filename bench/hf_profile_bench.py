"""Benchmark: full-size Hugging Face configs (runtime/models/hf_configs/) profiled on the meta device.

Target (issue 12): each under 60 s and under 4 GB peak RSS. Each model runs in a fresh process (its RSS is its
own; importing transformers is counted). CPU seconds are printed next to wall seconds: on a shared machine the
wall time includes waiting for a core.  Needs transformers (pip install -e ".[hf]").
Run: python bench/hf_profile_bench.py
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ROOT / "runtime" / "models" / "hf_configs"
MODELS = ("llava-1.5-7b", "qwen2-vl-7b", "qwen2-audio-7b")
TARGET_S, TARGET_BYTES = 60.0, 4e9

CHILD = """
import json, resource, sys, time
t0 = time.perf_counter()
from runtime.source import resolve
from planner.profiler.profile import profile_model
from plans.graph import save_profile
p = profile_model(resolve(sys.argv[1]), device="meta")
save_profile(p, sys.argv[2])
wall = time.perf_counter() - t0
usage = resource.getrusage(resource.RUSAGE_SELF)
print(json.dumps({"wall_s": wall, "cpu_s": usage.ru_utime + usage.ru_stime, "rss_bytes": usage.ru_maxrss * 1024,
                  "blocks": len(p.blocks), "params": sum(b.params for b in p.blocks), "groups": list(p.groups)}))
"""


def main() -> int:
    ok = True
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    print(f"{'model':<16} {'blocks':>6} {'params':>8} {'wall s':>7} {'cpu s':>6} {'target':>6} {'peak RSS':>9} {'target':>6}  groups")
    with tempfile.TemporaryDirectory() as tmp:
        for model in MODELS:
            out = Path(tmp) / f"{model}.json"
            res = subprocess.run([sys.executable, "-c", CHILD, f"hf:{CONFIGS / model}", str(out)], capture_output=True,
                                 text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
            if res.returncode:
                print(f"{model:<16} FAILED: {res.stderr.strip().splitlines()[-1]}")
                ok = False
                continue
            r = json.loads(res.stdout.strip().splitlines()[-1])
            met = r["wall_s"] < TARGET_S and r["rss_bytes"] < TARGET_BYTES
            ok &= met
            print(f"{model:<16} {r['blocks']:>6} {r['params'] / 1e9:>7.2f}B {r['wall_s']:>7.1f} {r['cpu_s']:>6.1f} {'<60':>6} "
                  f"{r['rss_bytes'] / 1e9:>7.2f}GB {'<4GB':>6}  {'met' if met else 'MISSED'}  {', '.join(r['groups'])}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

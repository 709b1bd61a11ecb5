"""Benchmark: profile the largest zoo models on the meta device; wall time and peak RSS per model.

Target (issue 2): each under 30 s and under 4 GB on a 2-core machine. Each model runs in a fresh
process so peak RSS is its own.  Run: python bench/profile_bench.py
"""
from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODELS = ("qwen2-vl-72b", "vit22b-llama70b")
TARGET_S, TARGET_BYTES = 30.0, 4e9

CHILD = """
import json, resource, sys, time
t0 = time.perf_counter()
from runtime.source import resolve
from planner.profiler.profile import profile_model
from plans.graph import save_profile
p = profile_model(resolve(sys.argv[1]), device="meta")
save_profile(p, sys.argv[2])
wall = time.perf_counter() - t0
rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
print(json.dumps({"wall_s": wall, "rss_bytes": rss, "blocks": len(p.blocks), "params": sum(b.params for b in p.blocks)}))
"""


def main() -> int:
    ok = True
    print(f"{'model':<18} {'blocks':>6} {'params':>10} {'wall s':>8} {'target':>7} {'peak RSS':>10} {'target':>7}")
    with tempfile.TemporaryDirectory() as tmp:
        for model in MODELS:
            out = Path(tmp) / f"{model}.json"
            res = subprocess.run([sys.executable, "-c", CHILD, model, str(out)], capture_output=True, text=True, check=True)
            r = json.loads(res.stdout.strip().splitlines()[-1])
            met = r["wall_s"] < TARGET_S and r["rss_bytes"] < TARGET_BYTES
            ok &= met
            print(f"{model:<18} {r['blocks']:>6} {r['params'] / 1e9:>9.1f}B {r['wall_s']:>8.1f} {'<30':>7} "
                  f"{r['rss_bytes'] / 1e9:>8.2f}GB {'<4GB':>7}  {'met' if met else 'MISSED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

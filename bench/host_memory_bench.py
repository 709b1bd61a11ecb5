"""What keeping freed host memory in the process (runtime/host_memory.py) buys a CPU rank: a model's training step
(forward + backward, then torch's Adam, one torch thread as a rank runs) in fresh processes, with glibc's default
malloc and with the rank's setting, alternated so that the machine's drift hits both alike; the median of each
process's median step. Target: the Adam step at least 1.3x faster and forward + backward no slower (the demo
model's 4.2 M-element embedding and head make Adam's temporaries large enough for glibc to map and unmap them).

Run: python bench/host_memory_bench.py [--model runtime.models.conv_vlm:factory] [--micro-batch 4] [--pairs 3] [--steps 16]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# One process: warm-up steps, then the median forward + backward and Adam step of the rest (seconds, as JSON).
_CHILD = """
import json, statistics, sys, time, torch
torch.set_num_threads(1)
model_name, micro_batch, steps, keep = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "keep"
if keep:
    from runtime.host_memory import keep_freed_memory
    assert keep_freed_memory(), "glibc's mallopt was not applied"
from runtime.source import call_factory, resolve
model, batch = call_factory(resolve(model_name), micro_batch)
adam = torch.optim.Adam(model.parameters(), lr=1e-3)
fb, opt = [], []
for _ in range(steps):
    t0 = time.perf_counter(); model(**batch).backward(); t1 = time.perf_counter()
    adam.step(); adam.zero_grad(); t2 = time.perf_counter()
    fb.append(t1 - t0); opt.append(t2 - t1)
warm = min(4, steps - 1)
print(json.dumps([statistics.median(fb[warm:]), statistics.median(opt[warm:])]))
"""


def one_process(model: str, micro_batch: int, steps: int, keep: bool) -> tuple[float, float]:
    env = dict(os.environ)
    if not keep:  # a glibc tunable names malloc: host_memory leaves glibc as it comes (check=0 is its default)
        env["GLIBC_TUNABLES"] = "glibc.malloc.check=0"
    out = subprocess.run([sys.executable, "-c", _CHILD, model, str(micro_batch), str(steps), "keep" if keep else "default"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    if out.returncode:
        raise SystemExit(f"the measuring process failed: {out.stderr.strip().splitlines()[-1] if out.stderr.strip() else out.returncode}")
    fb, opt = json.loads(out.stdout.strip().splitlines()[-1])
    return fb, opt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="runtime.models.conv_vlm:factory")
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--steps", type=int, default=16)
    a = ap.parse_args()
    runs: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
    for i in range(a.pairs):
        for keep in (False, True):
            runs[keep].append(one_process(a.model, a.micro_batch, a.steps, keep))
            fb, opt = runs[keep][-1]
            print(f"pair {i + 1}: {'kept  ' if keep else 'glibc '} forward+backward {fb * 1e3:7.1f} ms   Adam {opt * 1e3:6.1f} ms", flush=True)
    med = {k: (statistics.median(r[0] for r in v), statistics.median(r[1] for r in v)) for k, v in runs.items()}
    fb_ratio, opt_ratio = med[False][0] / med[True][0], med[False][1] / med[True][1]
    print(f"\n{a.model}, micro-batch {a.micro_batch}, 1 thread; median of {a.pairs} processes each ({a.steps} steps, 4 warm-up)")
    print(f"{'':24s}{'glibc default':>14s}{'memory kept':>14s}{'speed-up':>10s}   target")
    print(f"{'forward + backward':24s}{med[False][0] * 1e3:11.1f} ms{med[True][0] * 1e3:11.1f} ms{fb_ratio:9.2f}x   >= 1.0x (no slower)"
          f"  {'met' if fb_ratio >= 0.97 else 'MISSED'}")
    print(f"{'Adam step':24s}{med[False][1] * 1e3:11.1f} ms{med[True][1] * 1e3:11.1f} ms{opt_ratio:9.2f}x   >= 1.3x"
          f"  {'met' if opt_ratio >= 1.3 else 'MISSED'}")


if __name__ == "__main__":
    main()

"""How much of the data-parallel gradient all-reduce the bucketed reduction (runtime/grad_buckets.py) hides
behind the backward: dp ranks on this machine (gloo on CPU), a stack of transformer layers, the time from the
start of the backward until every gradient is summed, with the reduction after the backward (one flat
all-reduce, today's sync) vs in buckets during it. Median of --repeats runs each, interleaved.

Run: python bench/dp_overlap_bench.py [--ranks 2] [--layers 8] [--hidden 512] [--bucket-mb 25] [--repeats 7]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

from runtime.grad_buckets import GradBuckets  # noqa: E402
from runtime.launch import RankContext, launch  # noqa: E402
from runtime.models.layers import TransformerLayer  # noqa: E402


def _flat_all_reduce(params: list[nn.Parameter]) -> None:
    flat = torch.cat([p.grad.reshape(-1) for p in params])
    dist.all_reduce(flat)
    offset = 0
    for p in params:
        p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))
        offset += p.numel()


def _worker(ctx: RankContext, args: argparse.Namespace) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(*[TransformerLayer(args.hidden, 8, 4 * args.hidden, causal=True) for _ in range(args.layers)])
    params = list(model.parameters())
    buckets = GradBuckets(params, dist.group.WORLD, int(args.bucket_mb * 2**20))
    x = torch.randn(args.batch, args.seq, args.hidden)
    times: dict[str, list[float]] = {"backward only": [], "sync": [], "bucketed": []}
    for i in range(args.repeats + 1):  # the first round warms up
        for mode in times:
            for p in params:
                p.grad = None
            loss = model(x).square().mean()
            dist.barrier()
            t0 = time.perf_counter()
            if mode == "bucketed":
                buckets.arm()
            loss.backward()
            if mode == "sync":
                _flat_all_reduce(params)
            elif mode == "bucketed":
                buckets.finish()
            if i:
                times[mode].append(time.perf_counter() - t0)
    buckets.close()
    comm = []
    for _ in range(args.repeats):  # the all-reduce alone, for the exposed fraction
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(flat)
        comm.append(time.perf_counter() - t0)
    return {"times": times, "comm": comm, "grad_mb": sum(p.numel() * 4 for p in params) / 2**20,
            "buckets": len(buckets.buckets)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--bucket-mb", type=float, default=25.0)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    result = launch(_worker, args.ranks, args, timeout_s=900, op_timeout_s=300)[0]
    med = {k: statistics.median(v) for k, v in result["times"].items()}
    comm = statistics.median(result["comm"])
    print(f"{args.ranks} ranks (gloo, CPU), {args.layers} layers h={args.hidden}, {result['grad_mb']:.1f} MB of "
          f"gradients in {result['buckets']} buckets of {args.bucket_mb:g} MB; median of {args.repeats} runs")
    print(f"  backward alone              {med['backward only'] * 1e3:8.1f} ms")
    print(f"  all-reduce alone            {comm * 1e3:8.1f} ms")
    for mode in ("sync", "bucketed"):
        exposed = med[mode] - med["backward only"]
        print(f"  backward + reduce, {mode:8s} {med[mode] * 1e3:8.1f} ms  (exposed communication "
              f"{exposed * 1e3:7.1f} ms = {exposed / comm:5.0%} of the all-reduce)")
    print(f"  hidden by bucketing: {(med['sync'] - med['bucketed']) * 1e3:.1f} ms "
          f"({(med['sync'] - med['bucketed']) / comm:.0%} of the all-reduce)")


if __name__ == "__main__":
    main()

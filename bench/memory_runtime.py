"""The runtime's measured saved-activation bytes per transformer layer and tp rank, per activation option, next to
Korthikanti et al. 2022 Table 2 (runtime/activation_bytes.py measures; bench/memory_bench.py may print these
rows as its "runtime measured" column through `runtime_rows`).

Run: python bench/memory_runtime.py [--tp 8] [--attention flash|math]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from runtime.activation_bytes import LayerShape, table  # noqa: E402

# GPT-3 175B (Brown et al. 2020) as in Korthikanti et al. Table 3; a LLaMA-2-70B layer (GQA, SwiGLU)
LAYERS = {
    "gpt3-175b": LayerShape(hidden=12288, heads=96, seq=2048, micro_batch=1),
    "llama2-70b": LayerShape(hidden=8192, heads=64, seq=4096, micro_batch=1, mlp=28672, kv_heads=8, kind="llama"),
}


def runtime_rows(shape: LayerShape, tp: int, attention: str = "flash") -> list[dict]:
    """Per option (none, tp, tp+sp, tp+selective, tp+sp+selective, full): measured and Table 2 bytes."""
    return table(shape, tp, attention=attention)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--attention", choices=["flash", "math"], default="flash")
    args = ap.parse_args()
    for name, shape in LAYERS.items():
        print(f"{name}: s={shape.seq} b={shape.micro_batch} h={shape.hidden} a={shape.heads} t={args.tp}, bf16, "
              f"{args.attention} attention; bytes per layer and tp rank, in units of sbh")
        print(f"  {'option':17s} {'runtime':>9s} {'Table 2':>9s} {'ratio':>6s}")
        for r in runtime_rows(shape, args.tp, args.attention):
            print(f"  {r['option']:17s} {r['measured_sbh']:9.3f} {r['table2_sbh']:9.3f} {r['ratio']:6.3f}")


if __name__ == "__main__":
    main()

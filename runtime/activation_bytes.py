"""What one transformer layer of the runtime saves for its backward, measured, per tp rank and micro-batch,
for each activation option (none, tp, tp+sp, selective, full recompute), next to Korthikanti et al. 2022 Table 2.

Measured, not computed: the zoo's TransformerLayer runs forward under the same code the runtime trains with
(apply_tp, sequence parallelism, the selective / recompute tiers), on fake tensors (FakeTensorMode: shapes
and dtypes, no memory, so GPT-3-size layers cost nothing) and, for tp > 1, a fake process group of tp ranks
(collectives are no-ops with the right shapes); a saved-tensor hook sitting where the runtime's tier hooks sit
adds up every distinct storage autograd saves, parameters excluded, as runtime/activations.py counts them.
Full recompute saves nothing inside the layer; what it keeps is the checkpoint's input, counted as such.

Why our numbers differ from Table 2 (GPT, 16-bit activations, 1-byte dropout masks, attention with explicit
softmax): our layers have no dropout (Table 2 counts 2 masks of sbh bytes outside the regions and one of
as^2 b inside the core); attention runs as one fused kernel (scaled_dot_product_attention: flash on CPU and
GPU) that saves q, k, v, its output (B, H, S, hd) and a float32 log-sum-exp (4abs bytes) instead of the
softmax and dropout tensors (5as^2 b), and its output is saved a second time, transposed and flattened,
as the out-projection's input; LayerNorm saves its float mean and rstd; a SwiGLU MLP (LLaMA) saves its two
input projections and the gated product instead of GeLU's input and output. `breakdown` lists every tensor.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.checkpoint import checkpoint

from plans.errors import MmplanError

from .models.layers import TransformerLayer, recompute_attention_core
from .sequence_parallel import set_sequence_ends
from .tensor_parallel import apply_tp

Option = Literal["none", "tp", "tp+sp", "tp+selective", "tp+sp+selective", "full"]
OPTIONS: tuple[Option, ...] = ("none", "tp", "tp+sp", "tp+selective", "tp+sp+selective", "full")


@dataclass(frozen=True)
class LayerShape:
    """One transformer layer and its input: hidden h, heads a, sequence s, micro-batch b, MLP width."""

    hidden: int
    heads: int
    seq: int
    micro_batch: int = 1
    mlp: int | None = None  # None: 4h
    kv_heads: int | None = None
    kind: Literal["gpt", "llama"] = "gpt"  # LayerNorm + GeLU + biases | RMSNorm + SwiGLU + rotary, no biases

    def build(self) -> TransformerLayer:
        mlp = self.mlp or 4 * self.hidden
        if self.kind == "gpt":
            return TransformerLayer(self.hidden, self.heads, mlp, n_kv_heads=self.kv_heads, norm="layernorm",
                                    mlp="gelu", causal=True)
        return TransformerLayer(self.hidden, self.heads, mlp, n_kv_heads=self.kv_heads, norm="rmsnorm",
                                mlp="swiglu", causal=True, rotary=True, bias=False)


@dataclass(frozen=True)
class Measured:
    """Bytes one layer saves for its backward on one tp rank, and each saved tensor (shape, dtype, bytes)."""

    bytes: int
    breakdown: tuple[tuple[tuple[int, ...], str, int], ...]


@contextlib.contextmanager
def _fake_group(tp: int) -> Iterator[None]:
    """A fake process group of tp ranks (this process is rank 0) for the measurement, removed afterwards."""
    if tp == 1:
        yield
        return
    if dist.is_initialized():
        raise MmplanError("measure activation bytes outside a distributed job (it builds a fake process group)")
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=0, world_size=tp, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


def measure_layer(shape: LayerShape, *, tp: int = 1, sequence_parallel: bool = False,
                  tier: Literal["keep", "selective", "recompute"] = "keep",
                  dtype: torch.dtype = torch.bfloat16, attention: Literal["flash", "math"] = "flash") -> Measured:
    """Saved-activation bytes of one layer's forward on tp rank 0, inside a run of sequence-parallel layers
    when sequence_parallel (its input and output are sequence slices), with the activation tier `tier`.
    attention "math" forces scaled_dot_product_attention's unfused kernel (explicit softmax, as Table 2 has it)."""
    if sequence_parallel and tp == 1:
        raise MmplanError("sequence parallelism needs tp > 1")
    seq = shape.seq // tp if sequence_parallel else shape.seq
    before = torch.get_default_dtype()
    kernel = SDPBackend.MATH if attention == "math" else SDPBackend.FLASH_ATTENTION
    with _fake_group(tp), FakeTensorMode(), sdpa_kernel(kernel):
        torch.set_default_dtype(dtype)  # build in the activation dtype (fake parameters cannot be cast)
        try:
            layer = shape.build()
        finally:
            torch.set_default_dtype(before)
        apply_tp(layer, None, 0, tp, sequence_parallel=sequence_parallel)
        if sequence_parallel:
            set_sequence_ends(layer, None, scatter_in=False, gather_out=False)
        params = {p.untyped_storage()._cdata for p in layer.parameters()}
        x = torch.randn(shape.micro_batch, seq, shape.hidden, dtype=dtype, requires_grad=True)
        seen: dict[int, tuple[tuple[int, ...], str, int]] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            storage = t.untyped_storage()
            if storage._cdata not in params:
                seen.setdefault(storage._cdata, (tuple(t.shape), str(t.dtype).removeprefix("torch."), storage.nbytes()))
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            if tier == "recompute":
                checkpoint(layer, x, use_reentrant=False)
                seen[x.untyped_storage()._cdata] = (tuple(x.shape), "input kept by the checkpoint", x.untyped_storage().nbytes())
            elif tier == "selective":
                with recompute_attention_core():
                    layer(x)
            else:
                layer(x)
    rows = tuple(seen.values())
    return Measured(sum(r[2] for r in rows), rows)


def measure_option(shape: LayerShape, option: Option, tp: int, *, dtype: torch.dtype = torch.bfloat16,
                   attention: Literal["flash", "math"] = "flash") -> Measured:
    """measure_layer for one of Table 2's rows (tp ignored by 'none' and 'full', which run unsharded)."""
    sp = "sp" in option
    tier = "recompute" if option == "full" else "selective" if "selective" in option else "keep"
    t = 1 if option in ("none", "full") else tp
    return measure_layer(shape, tp=t, sequence_parallel=sp, tier=tier, dtype=dtype, attention=attention)


def korthikanti_table2(shape: LayerShape, option: Option, tp: int) -> float:
    """Bytes per layer from Korthikanti et al. 2022, Table 2 (16-bit activations, GPT layer, 1-byte masks)."""
    s, b, h, a, t = shape.seq, shape.micro_batch, shape.hidden, shape.heads, tp
    sbh = s * b * h
    return {
        "none": sbh * (34 + 5 * a * s / h),
        "tp": sbh * (10 + 24 / t + 5 * a * s / (h * t)),
        "tp+sp": sbh * (34 / t + 5 * a * s / (h * t)),
        "tp+selective": sbh * (10 + 24 / t),
        "tp+sp+selective": sbh * 34 / t,
        "full": 2 * sbh,
    }[option]


def table(shape: LayerShape, tp: int, *, dtype: torch.dtype = torch.bfloat16,
          attention: Literal["flash", "math"] = "flash") -> list[dict]:
    """Per option: the runtime's measured bytes, Table 2's bytes, and both in units of sbh."""
    sbh = shape.seq * shape.micro_batch * shape.hidden
    rows = []
    for option in OPTIONS:
        measured = measure_option(shape, option, tp, dtype=dtype, attention=attention).bytes
        paper = korthikanti_table2(shape, option, tp)
        rows.append({"option": option, "measured_bytes": measured, "table2_bytes": paper,
                     "measured_sbh": measured / sbh, "table2_sbh": paper / sbh, "ratio": measured / paper})
    return rows

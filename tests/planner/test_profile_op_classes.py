"""The profile's work by op class, saved activations by TP region / attention core, and vocabulary roles."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from planner.profiler.profile import profile_model
from runtime.models.layers import TransformerLayer
from runtime.source import ModelSource

S, H, A, V = 16, 32, 4, 96


class TinyGPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(V, H)
        self.layers = nn.ModuleList([TransformerLayer(H, A, 4 * H, causal=True)])
        self.head = nn.Linear(H, V, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        # the runtime shards a head over the vocabulary when only F.cross_entropy reads it (vocab_parallel.HeadPaths)
        return nn.functional.cross_entropy(self.head(x).float().flatten(0, 1), ids.flatten())


@pytest.fixture(scope="module")
def profile():
    def factory(micro_batch: int):
        return TinyGPT(), {"ids": torch.zeros(micro_batch, S, dtype=torch.long)}

    return profile_model(ModelSource("tiny-gpt", factory, "fp32"), micro_batch=2)


def test_flops_split_into_gemms_and_fused_attention(profile):
    layer = profile.block("layers.0")
    assert layer.fwd_matmul_flops == 2 * S * (4 * H * H + 8 * H * H)  # q, k, v, o and the two MLP projections
    assert layer.matmuls == 6 and sum(n for _, _, n in layer.fwd_gemms) == 6
    assert sum(f * n for f, _, n in layer.fwd_gemms) == layer.fwd_matmul_flops
    # causal SDPA executes half the score matrix; fwd_flops keeps torch's full count
    assert layer.fwd_attention_flops == 2 * S * S * H
    assert layer.fwd_flops == layer.fwd_matmul_flops + 2 * layer.fwd_attention_flops
    assert layer.fwd_memory_bytes > 0 and layer.bwd_memory_bytes > 0
    assert 0 < layer.replicated_memory_fraction < 1


def test_saved_activations_by_how_tensor_parallelism_stores_them(profile):
    layer, f32 = profile.block("layers.0"), 4
    # replicated: both norms' inputs and outputs (the column-parallel linears' input), plus LayerNorm's mean and rstd
    norms = 4 * S * H * f32 + 2 * 2 * S * f32
    assert layer.activation_replicated_bytes == norms
    # attention core: SDPA's logsumexp (q, k, v come from the linears and stay; SDPA's output is the output
    # projection's input, which that Linear keeps when selective recompute drops the core)
    assert layer.attention_core_bytes == A * S * f32
    assert layer.activation_bytes > layer.activation_replicated_bytes + layer.attention_core_bytes


def test_vocabulary_roles(profile):
    assert profile.block("embed").vocab_parallel == "embedding"
    assert profile.block("head").vocab_parallel == "head"
    assert profile.block("layers.0").vocab_parallel == ""


class _Chain(nn.Module):
    """Two elementwise ops in a row: a fused kernel reads x and writes the result; eager PyTorch also writes and
    reads the intermediate."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x * 2.0) * 3.0


class _ChainModel(TinyGPT):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([_Chain()])


def test_eager_traffic_counts_every_elementwise_op_and_fused_only_the_chain_ends():
    def factory(micro_batch: int):
        return _ChainModel(), {"ids": torch.zeros(micro_batch, S, dtype=torch.long)}

    fused, eager = (profile_model(ModelSource("chain", factory, "fp32"), micro_batch=2, fused=f).block("layers.0")
                    for f in (True, False))
    x = S * H * 4  # bytes of one sample's (S, H) fp32 activation
    assert fused.fwd_memory_bytes == 2 * x and eager.fwd_memory_bytes == 4 * x  # read x, (write t, read t,) write y
    assert fused.bwd_memory_bytes == 2 * x and eager.bwd_memory_bytes == 4 * x


class _SoftmaxDropout(nn.Module):
    """softmax, then dropout as its own op, between two Linears (an attention core's probabilities, in miniature)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj, self.out = nn.Linear(H, H), nn.Linear(H, H)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = torch.ops.aten.native_dropout(torch.softmax(self.proj(x), dim=-1), 0.1, True)[0]
        return self.out(probs)


class _SoftmaxDropoutModel(TinyGPT):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([_SoftmaxDropout()])


def test_softmax_grad_in_memory_writes_and_reads_the_dropout_gradient_once_more():
    # Megatron-LM: the attention dropout is a kernel of its own after the fused softmax, so in the backward the
    # dropout's input gradient goes through memory before the softmax backward reads it; fused counting keeps it on
    # chip. Exactly one (S, H) tensor more is written and read per sample in the backward; the forward is unchanged
    def factory(micro_batch: int):
        return _SoftmaxDropoutModel(), {"ids": torch.zeros(micro_batch, S, dtype=torch.long)}

    chip, memory = (profile_model(ModelSource("sd", factory, "fp32"), micro_batch=2, softmax_grad_in_memory=f)
                    .block("layers.0") for f in (False, True))
    x = S * H * 4  # bytes of one sample's (S, H) fp32 tensor
    assert memory.fwd_memory_bytes == chip.fwd_memory_bytes
    assert memory.bwd_memory_bytes == chip.bwd_memory_bytes + 2 * x


class _MathAttentionLayer(nn.Module):
    """Attention with an explicit softmax (QK^T and AV as batched GEMMs), then a two-Linear MLP."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = _MathAttention()
        self.mlp = nn.Sequential(nn.Linear(H, 4 * H), nn.GELU(), nn.Linear(4 * H, H))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(x)
        return x + self.mlp(x)


class _MathAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(H, H) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B = x.shape[0]
        q, k, v = (w(x).view(B, S, A, H // A).transpose(1, 2) for w in (self.wq, self.wk, self.wv))  # (B, A, S, hd)
        probs = torch.softmax(q @ k.transpose(-1, -2), dim=-1)  # (B, A, S, S)
        return self.wo((probs @ v).transpose(1, 2).flatten(2))


class _MathGPT(TinyGPT):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([_MathAttentionLayer()])


def test_a_math_attention_core_records_its_own_gemms_and_a_fused_one_none(profile):
    # selective recompute reruns the core (Korthikanti et al. 2022, section 5): with an explicit softmax that is
    # QK^T and AV, GEMMs of fwd_gemms that ran in the attention region outside its Linears; the MLP's GEMMs and the
    # projections are not the core's, and a fused (SDPA) core is fwd_attention_flops, with no GEMMs of its own
    def factory(micro_batch: int):
        return _MathGPT(), {"ids": torch.zeros(micro_batch, S, dtype=torch.long)}

    layer = profile_model(ModelSource("math-gpt", factory, "fp32"), micro_batch=2).block("layers.0")
    assert sum(n for _, _, n in layer.attention_core_gemms) == 2
    assert sum(f * n for f, _, n in layer.attention_core_gemms) == 2 * (2 * S * S * H)  # QK^T and AV per sample
    assert layer.fwd_attention_flops == 0
    assert layer.fwd_matmul_flops == 2 * S * (4 * H * H + 8 * H * H) + 2 * (2 * S * S * H)
    assert profile.block("layers.0").attention_core_gemms == ()

"""Per-rank memory: ZeRO model states (paper's Figure 1), activations in flight per schedule, tiers."""
from __future__ import annotations

import pytest

from cost_models.memory import (
    TierBytes,
    activation_residency,
    activation_transient,
    block_input_bytes,
    in_flight,
    model_state_bytes,
    optimizer_bytes_per_param,
    stage_memory,
    state_residency,
    warmup_forwards,
    zero_divisors,
)
from plans.errors import MmplanError
from plans.graph import Block, Edge, Profile
from plans.plan import Memory

GB = 1e9


@pytest.mark.parametrize("zero,figure_gb,digits", [(0, 120, 9), (1, 31.4, 1), (2, 16.6, 1), (3, 1.875, 9)])
def test_zero_paper_figure_1(zero, figure_gb, digits):
    # Rajbhandari et al. 2020, Figure 1: 7.5 B parameters, Nd = 64, mixed-precision Adam (K = 12):
    # 120 GB, 31.4 GB, 16.6 GB and 1.875 GB per device for baseline DP and ZeRO stages 1-3 (the figure
    # prints stages 1 and 2 to one decimal).
    state = model_state_bytes(7.5e9, dp=64, zero=zero, dtype="bf16", optimizer="adam")
    assert round(state.total / GB, digits) == figure_gb


def test_optimizer_state_sizes():
    assert optimizer_bytes_per_param("bf16", "adam") == 12  # ZeRO section 3.1: K = 12
    assert optimizer_bytes_per_param("fp32", "adam") == 8  # momentum + variance, the fp32 weights are the master
    assert optimizer_bytes_per_param("fp16", "sgd") == 8
    assert model_state_bytes(1e9, dp=1, zero=3, dtype="fp32").total == 16e9


@pytest.mark.parametrize("p,m", [(4, 8), (8, 4), (1, 3)])
def test_in_flight_micro_batches_per_schedule(p, m):
    for i in range(p):
        # 1F1B: stage i holds min(m, p - i) (Narayanan et al. 2021, 2.2.1); GPipe holds all m.
        assert in_flight("1f1b", m, warmup_forwards("1f1b", m, p - i - 1)) == min(m, p - i)
        assert in_flight("gpipe", m, warmup_forwards("gpipe", m, p - i - 1)) == m


def test_interleaved_first_stage_matches_korthikanti():
    p, v, m = 8, 4, 64
    # Korthikanti et al. 2022 4.2.3: the first stage of the interleaved schedule holds p (1 + (p-1)/(p v)).
    first, last = (warmup_forwards("interleaved", m, down, v, p) for down in (p - 1, 0))
    assert in_flight("interleaved", m, first, v) == pytest.approx(p * (1 + (p - 1) / (p * v)))
    assert in_flight("interleaved", m, last, v) < in_flight("interleaved", m, first, v)


def chain(n: int = 3) -> Profile:
    blocks = tuple(Block(f"b{i}", "g", "Layer", 1000, 2000, 1.0, 2.0, activation_bytes=100.0 * (i + 1),
                         output_bytes=10.0 * (i + 1), supports_tp=i > 0) for i in range(n))
    edges = tuple(Edge(f"b{i}", f"b{i + 1}", 10.0 * (i + 1)) for i in range(n - 1))
    return Profile.build("chain", "bf16", 1, blocks, edges)


def memory_of(profile: Profile, memory: Memory, *, tp: int = 1, dp: int = 1, zero: int = 0, flight: float = 4) -> TierBytes:
    return stage_memory(profile.blocks, samples=2, tp=tp, dp=dp, zero=zero, memory=memory, in_flight_micro_batches=flight,
                        input_bytes=block_input_bytes(profile))


def test_recompute_keeps_only_the_block_input_plus_one_block():
    profile = chain()
    keep = memory_of(profile, Memory())
    recompute = memory_of(profile, Memory(activations={"b1": "recompute", "b2": "recompute"}))
    # b1 keeps its input (b0's output, 10 B/sample) instead of 200 B/sample; b2 keeps 20 instead of 300;
    # one of them (the larger, b2) is rebuilt at a time.
    saved = 4 * 2 * ((200 - 10) + (300 - 20)) - 2 * 300
    assert keep.gpu - recompute.gpu == pytest.approx(saved)


def test_offloaded_activations_and_states_move_tiers():
    profile = chain()
    gpu_only = memory_of(profile, Memory())
    moved = memory_of(profile, Memory(optimizer="cpu", activations={"b2": "offload-nvme"}))
    assert moved.cpu == 12 * 3000  # the optimizer states of all 3000 parameters
    assert moved.nvme == 4 * 2 * 300  # b2's activations for the 4 micro-batches in flight
    assert moved.gpu + moved.cpu + moved.nvme - 2 * 2 * 300 == pytest.approx(gpu_only.gpu)  # + a 2-block buffer


def test_tensor_parallel_divides_only_the_blocks_that_support_it():
    profile = chain()
    one, two = memory_of(profile, Memory()), memory_of(profile, Memory(), tp=2)
    # b1, b2 (2000 params, 500 B/sample of activations) halve; b0 (1000 params, 100 B/sample) does not.
    assert one.gpu - two.gpu == pytest.approx(16 * 2000 / 2 + 4 * 2 * 500 / 2)


def test_block_input_bytes_falls_back_to_the_previous_output():
    profile = chain()
    assert block_input_bytes(profile) == {"b0": 0.0, "b1": 10.0, "b2": 20.0}
    bare = Profile("bare", "x", "bf16", 1, profile.blocks, ())
    assert block_input_bytes(bare) == {"b0": 0.0, "b1": 10.0, "b2": 20.0}


@pytest.mark.parametrize("zero,shares", [(0, (1, 1, 1)), (1, (1, 1, 8)), (2, (1, 8, 8)), (3, (8, 8, 8))])
def test_zero_divisors_name_the_sharded_states(zero, shares):
    # ZeRO section 5: P_os shards the optimizer states, P_os+g also the gradients, P_os+g+p also the parameters
    assert tuple(zero_divisors(zero, 8)) == shares
    with pytest.raises(MmplanError, match="ZeRO stage"):
        zero_divisors(4, 8)


def test_off_device_gradients_keep_one_block_on_the_gpu():
    # runtime/param_tiers.GradTier moves each gradient out as soon as it has accumulated: one block's gradients
    # are on the device at a time; parameters streamed from another tier keep two blocks (in use + prefetched)
    on_gpu = state_residency(3000, 2000, dp=1, zero=0, memory=Memory())
    grads_off = state_residency(3000, 2000, dp=1, zero=0, memory=Memory(grads="nvme"))
    params_off = state_residency(3000, 2000, dp=1, zero=0, memory=Memory(params="cpu"))
    assert grads_off.nvme == 2 * 3000 and on_gpu.gpu - grads_off.gpu == 2 * 3000 - 2 * 2000
    assert params_off.cpu == 2 * 3000 and on_gpu.gpu - params_off.gpu == 2 * 3000 - 2 * 2 * 2000
    sharded = state_residency(3000, 2000, dp=4, zero=2, memory=Memory(grads="cpu"))
    # ZeRO-2 on FSDP2: the unsharded parameters (2 x 3000) and the rank's shard beside them (2 x 3000 / 4)
    assert sharded.cpu == 2 * 3000 / 4 and sharded.gpu == 2 * 3000 * (1 + 1 / 4) + 12 * 3000 / 4 + 2 * 2000 / 4


def test_activation_residency_by_tier():
    assert activation_residency("keep", 100.0, 10.0) == TierBytes(gpu=100.0)
    assert activation_residency("recompute", 100.0, 10.0) == TierBytes(gpu=10.0)
    assert activation_residency("offload-nvme", 100.0, 10.0) == TierBytes(nvme=100.0)
    assert [activation_transient(t, 100.0) for t in ("keep", "recompute", "offload-cpu")] == [0.0, 100.0, 200.0]


@pytest.mark.parametrize("zero,dp,per_param", [(0, 8, 18.0), (1, 8, 6 + 12 / 8), (1, 64, 6 + 12 / 64)])
def test_megatron_grad_buffer_is_theoretical_memory_usage_bytes_per_parameter(zero, dp, per_param):
    # Megatron-LM, megatron/training/theoretical_memory_usage.py: 18 bytes per parameter (bf16 weight, fp32 main_grad,
    # fp32 Adam master + moments), 6 + 12/dp with the distributed optimizer (ZeRO-1; the gradient buffer unsharded)
    from cost_models.memory import grad_buffer_bytes

    blocks = [Block("b", "g", "Layer", 10**6, 2 * 10**6, 1.0, 2.0, 0.0, 0.0)]
    common = dict(samples=1.0, tp=1, dp=dp, zero=zero, memory=Memory(), in_flight_micro_batches=1.0, input_bytes={})
    mmplan = stage_memory(blocks, **common)
    megatron = stage_memory(blocks, **common, grad_buffer="fp32")
    assert megatron.gpu == pytest.approx(per_param * 10**6)
    assert megatron.gpu - mmplan.gpu == grad_buffer_bytes(10**6, dp=dp, zero=zero, grad_buffer="fp32") == 2 * 10**6
    assert grad_buffer_bytes(10**6, dp=dp, zero=zero) == 0  # mmplan's runtime: gradients in the training dtype
    assert grad_buffer_bytes(10**6, dp=4, zero=2, grad_buffer="fp32") == 2 * 10**6 / 4  # sharded like the gradients
    assert grad_buffer_bytes(10**6, dp=4, zero=0, dtype="fp32", grad_buffer="fp32") == 0  # fp32 gradients already
    with pytest.raises(MmplanError, match="grad_buffer"):
        grad_buffer_bytes(1.0, dp=1, zero=0, grad_buffer="fp8")


def test_megatron_grad_buffer_leaves_frozen_blocks_out():
    blocks = [Block("a", "g", "Layer", 10**6, 2 * 10**6, 1.0, 2.0, 0.0, 0.0),
              Block("f", "g", "Layer", 10**6, 2 * 10**6, 1.0, 2.0, 0.0, 0.0, frozen=True)]
    common = dict(samples=1.0, tp=1, dp=1, zero=0, memory=Memory(), in_flight_micro_batches=1.0, input_bytes={})
    assert stage_memory(blocks, **common, grad_buffer="fp32").gpu - stage_memory(blocks, **common).gpu == 2 * 10**6

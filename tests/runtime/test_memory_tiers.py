"""Memory tiers move bytes, never numbers: activations kept/offloaded/recomputed, params and Adam state off the device."""
from __future__ import annotations

import copy
import gc
import os
import shutil

import pytest
import torch
from torch import nn

from plans.errors import MmplanError
from runtime.memory import (
    ActivationTiers,
    DeviceBudget,
    GradTier,
    MemoryBudgetExceeded,
    ParamStore,
    RankTiers,
    TieredAdam,
    TieredBlocks,
    activation_context,
    check_nvme_space,
)
from runtime.models.layers import TransformerLayer

TIERS = ["keep", "offload-cpu", "offload-nvme", "recompute"]
BLOCKS = 4


@pytest.fixture(autouse=True)
def one_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def stack():
    torch.manual_seed(0)
    return nn.ModuleList(TransformerLayer(32, 4, 64) for _ in range(BLOCKS)), torch.randn(2, 8, 32)


def plain_grads(stack, x0):
    m = copy.deepcopy(stack)
    x = x0.clone().requires_grad_()
    h = x
    for b in m:
        h = b(h)
    h.pow(2).mean().backward()
    return [p.grad for p in m.parameters()] + [x.grad]


def run_tiered(stack, x0, tier, nvme_dir, *, prefetch=True, limit=None):
    """Forward + backward of the stack, every block in `tier`; returns (grads, budget report, peak after forward)."""
    m = copy.deepcopy(stack)
    budget = DeviceBudget(limit)
    with ActivationTiers(budget, nvme_dir=nvme_dir, prefetch=prefetch) as tiers:
        x = x0.clone().requires_grad_()
        h, saved = x, None
        for i, b in enumerate(m):
            h, saved = tiers.run_block(b, (h,), {}, tier, block=f"layers.{i}", previous=saved)
        loss = h.pow(2).mean()
        after_forward = budget.report()
        if prefetch:
            saved.prefetch()
        del h, saved
        loss.backward()
        del loss
        gc.collect()
        report = budget.report()
        report["stats"] = dict(tiers.stats)
    return [p.grad for p in m.parameters()] + [x.grad], report, after_forward


@pytest.mark.parametrize("tier", TIERS)
def test_gradients_bitwise_equal_plain_execution(stack, tier, tmp_path):
    module, x0 = stack
    want = plain_grads(module, x0)
    got, report, _ = run_tiered(module, x0, tier, tmp_path)
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    # everything the tiers counted is released once the backward is done (only the live input x remains)
    assert report["current"]["activations"] + report["current"]["buffers"] <= x0.numel() * 4
    assert report["host"] == {"cpu": 0, "nvme": 0}
    assert os.listdir(tmp_path) == []  # NVMe scratch directory removed on close


def test_offload_without_prefetch_is_also_exact(stack, tmp_path):
    module, x0 = stack
    want = plain_grads(module, x0)
    for tier in ("offload-cpu", "offload-nvme"):
        got, report, _ = run_tiered(module, x0, tier, tmp_path, prefetch=False)
        assert all(torch.equal(a, b) for a, b in zip(want, got))
        assert report["stats"]["prefetched"] == 0 and report["stats"]["on_demand"] > 0


@pytest.mark.parametrize("tier", ["offload-cpu", "offload-nvme"])
def test_backward_finds_every_block_prefetched(stack, tier, tmp_path):
    """The last block is prefetched by the caller, every other one by the unpack of the block after it."""
    module, x0 = stack
    _, report, _ = run_tiered(module, x0, tier, tmp_path)
    assert report["stats"]["on_demand"] == 0 and report["stats"]["prefetched"] > 0


def test_offload_and_recompute_lower_the_device_peak(stack, tmp_path):
    module, x0 = stack
    peaks = {tier: run_tiered(module, x0, tier, tmp_path)[1]["peak_total"] for tier in TIERS}
    keep = peaks["keep"]
    one_block = keep / BLOCKS
    # keep holds every block's activations; offload about two blocks (the one in backward and the one
    # prefetched, cost model: 2 x act); recompute the checkpointed inputs plus one recomputed block
    assert peaks["offload-cpu"] <= 2.2 * one_block < keep
    assert peaks["offload-nvme"] <= 3 * one_block < keep
    assert peaks["recompute"] <= 1.5 * one_block < keep


def test_keep_counts_what_the_profiler_counts():
    from planner.profiler.profile import (
        profile_model,  # tests may use the planner; runtime/ never does
    )
    from runtime.program import block_modules
    from runtime.source import call_factory, resolve

    prof = profile_model(resolve("tiny-vlm"), micro_batch=2)
    torch.manual_seed(0)
    model, batch = call_factory(resolve("tiny-vlm"), 2)
    blocks = block_modules(model)
    inputs = {}
    hooks = [m.register_forward_pre_hook(lambda mod, a, k, n=n: inputs.__setitem__(n, (a, k)), with_kwargs=True)
             for n, m in blocks.items()]
    with torch.no_grad():
        model(**batch)
    for h in hooks:
        h.remove()
    # blocks followed by glue (llm.norm: the text slice, llm.head: the loss) have the glue's saves in
    # their profile; every other block saves exactly what the profile says, per sample x batch
    checked = [b for b in prof.blocks if b.name not in ("llm.norm", "llm.head")]
    assert len(checked) >= 6
    for b in checked:
        args, kwargs = inputs[b.name]
        args = tuple(a.detach().clone().requires_grad_(a.is_floating_point()) for a in args)
        budget = DeviceBudget()
        tiers = ActivationTiers(budget)
        _, saved = tiers.run_block(blocks[b.name], args, kwargs, "keep", block=b.name)
        assert budget.current["activations"] == b.activation_bytes * 2 == saved.saved_bytes, b.name
        assert budget.peak["activations"] == b.activation_bytes * 2


def test_budget_smaller_than_needed_raises_with_the_numbers(stack, tmp_path):
    module, x0 = stack
    _, report, _ = run_tiered(module, x0, "keep", tmp_path)
    limit = report["peak_total"] // 2
    with pytest.raises(MemoryBudgetExceeded, match=r"device tier holds .* > budget .*: activations .*; give the plan more memory") as err:
        run_tiered(module, x0, "keep", tmp_path, limit=limit)
    assert isinstance(err.value, MmplanError)
    # the same budget is enough once the activations are recomputed
    run_tiered(module, x0, "recompute", tmp_path, limit=limit)


def test_budget_counts_storages_once_until_freed():
    budget = DeviceBudget()
    t = torch.zeros(100)
    assert budget.hold("activations", t) and not budget.hold("activations", t[10:])
    assert budget.current["activations"] == 400
    del t
    assert budget.total == 0 and budget.peak_total == 400
    w = nn.Parameter(torch.zeros(10))
    budget.ignore([w])
    assert not budget.hold("activations", w.t())


def test_budget_tells_a_new_storage_from_a_freed_one_at_the_same_address():
    """Storage keys (addresses) are reused after a free: each new storage is counted, each free released."""
    budget = DeviceBudget()
    for i in range(200):
        t = torch.zeros(25 + i % 3)
        assert budget.hold("grads" if i % 2 else "activations", t)
        assert budget.total == t.numel() * 4
        del t
        assert budget.total == 0
    report = budget.report()
    assert report["peak_total"] == 27 * 4 == sum(report["at_peak"].values())


def test_budget_counts_holds_from_two_threads():
    """The I/O thread counts the copies it brings back while the main thread counts what autograd saves."""
    import threading

    budget = DeviceBudget()
    mine = [torch.zeros(8) for _ in range(500)]
    theirs = [torch.zeros(4) for _ in range(500)]
    shared = torch.zeros(16)
    def count(tensors):
        for t in tensors:
            budget.hold("buffers", t)

    other = threading.Thread(target=count, args=([*theirs, shared],))
    other.start()
    held = [budget.hold("activations", t) for t in [*mine, shared]]
    other.join()
    assert all(held[:-1])
    assert budget.total == 500 * 8 * 4 + 500 * 4 * 4 + 16 * 4  # the shared storage counted once, by either thread
    del mine, theirs, shared
    report = budget.report()
    assert report["total"] == 0 and report["current"] == dict.fromkeys(report["current"], 0)


def test_keep_after_offload_still_prefetches_and_totals_add_up(stack, tmp_path):
    """A keep block's first unpack starts bringing back the offloaded block before it; gradients stay bitwise."""
    module, x0 = stack
    want = plain_grads(module, x0)
    m = copy.deepcopy(module)
    budget = DeviceBudget()
    with ActivationTiers(budget, nvme_dir=tmp_path) as tiers:
        x = x0.clone().requires_grad_()
        h, saved = x, None
        for i, (b, tier) in enumerate(zip(m, ["offload-cpu", "keep", "offload-nvme", "keep"])):
            h, saved = tiers.run_block(b, (h,), {}, tier, block=f"layers.{i}", previous=saved)
        h.pow(2).mean().backward()
        assert tiers.stats["on_demand"] == 0 and tiers.stats["prefetched"] > 0
    got = [p.grad for p in m.parameters()] + [x.grad]
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    report = budget.report()
    assert report["total"] == sum(report["current"].values())
    assert report["peak_total"] == sum(report["at_peak"].values())
    assert all(report["peak"][c] >= report["at_peak"][c] for c in report["peak"])


def test_standalone_activation_context_cleans_up(tmp_path):
    budget = DeviceBudget()
    lin = nn.Linear(8, 8)
    x = torch.randn(4, 8, requires_grad=True)
    with activation_context("offload-nvme", budget, nvme_dir=tmp_path):
        y = torch.tanh(lin(x)).sum()
    assert budget.host["nvme"] > 0
    y.backward()
    del y
    gc.collect()
    assert budget.host["nvme"] == 0
    assert os.listdir(tmp_path) == []


def test_check_nvme_space_refuses_more_than_free(tmp_path):
    free = shutil.disk_usage(tmp_path).free
    check_nvme_space(tmp_path, free // 2)
    with pytest.raises(MmplanError, match=r"has .* free but the plan needs"):
        check_nvme_space(tmp_path, free + 10**12)
    with pytest.raises(MmplanError, match="does not exist"):
        check_nvme_space(tmp_path / "missing", 1)


# --- optimizer state, parameters and gradients off the device ----------------------------------------


def _model():
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16), nn.LayerNorm(16))


def _batches(n=5):
    g = torch.Generator().manual_seed(2)
    return [torch.randn(4, 16, generator=g) for _ in range(n)]


def _adam_reference():
    m = _model()
    opt = torch.optim.Adam(m.parameters(), lr=1e-2, weight_decay=0.01)
    for x in _batches():
        m(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return m.state_dict(), opt


@pytest.mark.parametrize("tier", ["gpu", "cpu", "nvme"])
def test_tiered_adam_equals_torch_adam_over_5_steps(tier, tmp_path):
    want, ref_opt = _adam_reference()
    m = _model()
    budget = DeviceBudget()
    opt = TieredAdam(dict(m.named_parameters()), tier=tier, budget=budget, nvme_dir=tmp_path, lr=1e-2, weight_decay=0.01)
    state_bytes = 2 * sum(p.numel() * 4 for p in m.parameters())
    assert (budget.current["optimizer"], budget.host.get(tier, 0)) == ((state_bytes, 0) if tier == "gpu" else (0, state_bytes))
    if tier == "nvme":
        (sub,) = os.listdir(tmp_path)
        assert os.path.getsize(tmp_path / sub / "adam.bin") >= state_bytes
    for x in _batches():
        m(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    got = m.state_dict()
    assert all(torch.equal(want[k], got[k]) for k in want)
    ref_state = {n: ref_opt.state[p] for n, p in zip(dict(_model().named_parameters()), ref_opt.param_groups[0]["params"])}
    mine = opt.state_by_name()
    for n, s in ref_state.items():
        assert all(torch.equal(s[k], mine[n][k]) for k in ("step", "exp_avg", "exp_avg_sq"))
    opt.close()
    assert os.listdir(tmp_path) == []


def test_tiered_adam_state_round_trips_by_name(tmp_path):
    m = _model()
    a = TieredAdam(dict(m.named_parameters()), tier="nvme", nvme_dir=tmp_path, lr=1e-2)
    m(_batches(1)[0]).sum().backward()
    a.step()
    state = a.state_by_name()
    b = TieredAdam(dict(_model().named_parameters()), tier="cpu", lr=1e-2)
    b.load_state_by_name(state)
    assert all(torch.equal(state[n][k], b.state_by_name()[n][k]) for n in state for k in state[n])
    a.close()


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_params_off_device_train_bitwise_and_stream_one_block_ahead(tier, stack, tmp_path):
    """Params in a ParamStore + activations per block (offload/recompute mixed) + streamed Adam = plain Adam."""
    module, x0 = stack
    plain = copy.deepcopy(module)
    opt = torch.optim.Adam(plain.parameters(), lr=1e-2)
    for _ in range(2):
        h = x0
        for b in plain:
            h = b(h)
        h.pow(2).mean().backward()
        opt.step()
        opt.zero_grad()

    m = copy.deepcopy(module)
    names = [f"layers.{i}" for i in range(BLOCKS)]
    blocks = dict(zip(names, m))
    budget = DeviceBudget()
    store = ParamStore(blocks, tier, budget, nvme_dir=tmp_path)
    assert all(p.untyped_storage().nbytes() == 0 for p in m.parameters())  # off the device tier
    named = {f"{b}.{n}": p for b, mod in blocks.items() for n, p in mod.named_parameters()}
    adam = TieredAdam(named, tier="cpu", store=store, budget=budget, lr=1e-2)
    acts = {"layers.0": "offload-cpu", "layers.1": "recompute", "layers.2": "offload-nvme"}
    with ActivationTiers(budget, nvme_dir=tmp_path) as tiers:
        for _ in range(2):
            run = TieredBlocks(blocks, acts, tiers, store, order=names)
            h = x0
            for b in names:
                h = run[b](h)
            loss = h.pow(2).mean()
            run.prefetch_backward()
            loss.backward()
            store.end_backward()
            assert budget.current["params"] == 0  # every block released after its backward
            adam.step()
            adam.zero_grad()
    for b in names:
        state = store.block_state(b)
        for n, p in dict(zip(names, plain))[b].named_parameters():
            assert torch.equal(state[n], p.detach()), f"{b}.{n}"
    largest = max(store.nbytes.values())
    assert 0 < budget.peak["params"] <= 2 * largest  # one block in use plus one prefetched (cost model: 2 x largest)
    assert budget.peak["params"] > largest  # the prefetch really ran ahead
    params = sum(store.nbytes.values())
    assert budget.host["cpu"] == (params if tier == "cpu" else 0) + 2 * params  # params + Adam's exp_avg, exp_avg_sq
    assert budget.host["nvme"] == (params if tier == "nvme" else 0)
    store.close()
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_grads_off_device_accumulate_bitwise(tier, tmp_path):
    want = _model()
    xs = _batches(3)
    for x in xs:
        want(x).pow(2).mean().backward()
    m = _model()
    budget = DeviceBudget()
    grads = GradTier(m.parameters(), tier, budget, nvme_dir=tmp_path)
    nbytes = sum(p.numel() * p.element_size() for p in m.parameters())
    if tier == "nvme":  # one memory-mapped file in the NVMe directory holds every gradient
        (sub,) = os.listdir(tmp_path)
        assert os.path.getsize(tmp_path / sub / "grads.bin") >= nbytes
    for x in xs:
        m(x).pow(2).mean().backward()
        assert all(p.grad is None for p in m.parameters())  # moved off the device tier
        assert budget.host == {"cpu": nbytes if tier == "cpu" else 0, "nvme": nbytes if tier == "nvme" else 0}
    if tier == "nvme":  # the accumulated sums live in the file
        assert all(any(h.data_ptr() == s.data_ptr() for s in grads._slots.values()) for h in grads.host.values())
    grads.collect()
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(want.parameters(), m.parameters()))
    # each gradient is on the device only from its accumulation until it is moved: one tensor at a time
    assert budget.host == {"cpu": 0, "nvme": 0}
    assert 0 < budget.peak["grads"] <= max(p.numel() * p.element_size() for p in m.parameters())
    grads.close()
    assert os.listdir(tmp_path) == []


def test_grads_on_the_gpu_tier_stay_counted():
    budget_gpu = DeviceBudget()
    m2 = _model()
    GradTier(m2.parameters(), "gpu", budget_gpu)
    m2(_batches(1)[0]).sum().backward()
    assert budget_gpu.current["grads"] == sum(p.numel() * 4 for p in m2.parameters())


def test_whole_model_two_stages_through_program_evaluate(tmp_path):
    """train.py's path: RankTiers from two stages' Memory, program.evaluate over each stage's TieredBlocks;
    every tier in use (params, Adam and activations on NVMe, grads on the host, offload, recompute):
    2 steps bitwise equal to plain training with torch.optim.Adam."""
    from plans.plan import Memory
    from runtime.program import block_modules, evaluate, trace_program
    from runtime.source import call_factory, resolve

    def build():
        torch.manual_seed(0)
        return call_factory(resolve("tiny-vlm"), 2)

    ref, batch = build()
    opt = torch.optim.Adam(ref.parameters(), lr=1e-3)
    losses = []
    for _ in range(2):
        loss = ref(**batch)
        losses.append(loss.detach())
        loss.backward()
        opt.step()
        opt.zero_grad()

    model, batch = build()
    program = trace_program(model, batch)
    blocks = block_modules(model)
    order = list(program.blocks)
    first, second = order[:5], order[5:]
    cycle = ["offload-cpu", "recompute", "offload-nvme", "keep"]
    stages = [
        (first, Memory(params="gpu", grads="gpu", optimizer="cpu", activations={b: cycle[i % 4] for i, b in enumerate(first)})),
        (second, Memory(params="nvme", grads="cpu", optimizer="nvme", activations={b: cycle[(i + 1) % 4] for i, b in enumerate(second)})),
    ]
    tiers = RankTiers(stages, blocks, nvme_dir=tmp_path, lr=1e-3)

    def fetch(node):
        return batch[str(node.target)] if node.op == "placeholder" else model.get_parameter(str(node.target))

    for step in range(2):
        env: dict = {}
        runs = [tiers.blocks(names, blocks) for names, _ in stages]
        for run, (names, _) in zip(runs, stages):
            for b in names:
                evaluate(program.blocks[b], env, fetch, run)
        loss = evaluate(program.output, env, fetch, runs[-1])
        assert torch.equal(loss.detach(), losses[step])
        runs[-1].prefetch_backward()
        loss.backward()
        tiers.after_backward()
        tiers.before_reduce()
        tiers.step()
    for b in order:
        for n, t in tiers.block_params(b, blocks[b]).items():
            assert torch.equal(t, ref.get_parameter(n).detach()), n
    assert tiers.budget.current["params"] == sum(p.numel() * 4 for b in first for p in blocks[b].parameters())
    report = tiers.budget.report()
    assert report["host"]["nvme"] > 0 and report["peak"]["activations"] > 0 and report["peak"]["buffers"] > 0
    tiers.close()
    assert os.listdir(tmp_path) == []


def test_params_off_device_in_a_stage_whose_backward_starts_from_received_gradients(stack, tmp_path):
    """A non-loss pipeline stage: backward(roots=its outputs, grads=received) acquires its blocks in turn."""
    module, x0 = stack
    g = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(5))
    plain = copy.deepcopy(module)
    x = x0.clone().requires_grad_()
    h = x
    for b in plain:
        h = b(h)
    torch.autograd.backward([h], [g])
    want = [p.grad for p in plain.parameters()] + [x.grad]

    m = copy.deepcopy(module)
    names = [f"layers.{i}" for i in range(BLOCKS)]
    blocks = dict(zip(names, m))
    budget = DeviceBudget()
    store = ParamStore(blocks, "nvme", budget, nvme_dir=tmp_path, prefetch=False)
    with ActivationTiers(budget, nvme_dir=tmp_path, prefetch=False) as tiers:
        run = TieredBlocks(blocks, {"layers.1": "offload-nvme", "layers.2": "recompute"}, tiers, store, order=names)
        x = x0.clone().requires_grad_()
        h = x
        for b in names:
            h = run[b](h)
        run.prefetch_backward()
        torch.autograd.backward([h], [g])
        store.end_backward()
    got = [p.grad for p in m.parameters()] + [x.grad]
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    assert budget.current["params"] == 0 and budget.peak["params"] == max(store.nbytes.values())  # no prefetch: one block
    store.close()

"""Tests of the model zoo: tiny models train on CPU, real sizes match published parameter counts."""

import statistics
import time

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.flop_counter import FlopCounterMode

from runtime.models import (
    ZOO,
    ArchConfig,
    DecoderConfig,
    GatedCrossAttention,
    VisionConfig,
    build,
    default_dtype,
    names,
    resolve,
)

TINY = [name for name in names() if name.startswith("tiny-")]
REAL = [name for name in names() if not name.startswith("tiny-")]

# Published parameter totals, in billions.
PUBLISHED_PARAMS = {
    # LLaVA-1.5 (Liu et al. 2023; HF model cards liuhaotian/llava-v1.5-7b and -13b): 7.06 B and 13.35 B.
    "llava-1.5-7b": 7.06,
    "llava-1.5-13b": 13.35,
    # Qwen2-VL-72B (HF model card Qwen/Qwen2-VL-72B-Instruct): 73.4 B.
    "qwen2-vl-72b": 73.4,
    # ViT-22B (Dehghani et al. 2023, Table 1): 21.7 B; LLaMA-2-70B (Touvron et al. 2023): 68.98 B.
    "vit22b-llama70b": 21.7 + 68.98,
    # Whisper large-v3 encoder (half-ish of the 1.55 B model): 0.637 B; LLaMA-2-7B: 6.74 B.
    "whisper-llama-7b": 0.637 + 6.74,
}


def block_paths(module: nn.Module, prefix: str = "") -> dict[str, nn.Module]:
    """The profiler's blocks: ModuleList/Sequential elements, plus maximal submodules without either."""
    stacks = (nn.ModuleList, nn.Sequential)
    blocks = {}
    for name, child in module.named_children():
        path = prefix + name
        if isinstance(child, stacks):
            blocks.update({f"{path}.{i}": element for i, element in child.named_children()})
        elif any(isinstance(m, stacks) for m in child.modules()):
            blocks.update(block_paths(child, path + "."))
        else:
            blocks[path] = child
    return blocks


def build_tiny(name: str, micro_batch: int = 2):
    torch.manual_seed(0)
    return build(name, micro_batch)


def test_zoo_lists_every_named_configuration():
    assert TINY == ["tiny-vlm", "tiny-avlm", "tiny-flamingo", "tiny-clip", "tiny-vlm-tied", "tiny-vlm-heavy"]
    assert REAL == ["llava-1.5-7b", "llava-1.5-13b", "qwen2-vl-72b", "vit22b-llama70b", "whisper-llama-7b"]
    assert all(ZOO[n].dtype == "fp32" for n in TINY) and all(ZOO[n].dtype == "bf16" for n in REAL)
    assert default_dtype("tiny-vlm") is torch.float32 and default_dtype("llava-1.5-7b") is torch.bfloat16


@pytest.mark.parametrize("name", TINY)
def test_tiny_trains_on_cpu_with_finite_grads(name):
    model, batch = build_tiny(name)
    loss = model(**batch)
    assert loss.dim() == 0 and torch.isfinite(loss)
    loss.backward()
    for param_name, p in model.named_parameters():
        assert p.grad is not None, param_name
        assert torch.isfinite(p.grad).all(), param_name


@pytest.mark.parametrize("name", TINY)
def test_tiny_is_deterministic_given_the_seed(name):
    first_model, first_batch = build_tiny(name)
    second_model, second_batch = build_tiny(name)
    assert all(torch.equal(first_batch[k], second_batch[k]) for k in first_batch)
    assert torch.equal(first_model(**first_batch), second_model(**second_batch))


@pytest.mark.parametrize("name", TINY)
def test_tiny_blocks_are_each_called_once_and_own_every_parameter(name):
    model, batch = build_tiny(name)
    assert not any(isinstance(m, nn.Sequential) for m in model.modules())
    blocks = block_paths(model)
    calls = dict.fromkeys(blocks, 0)
    for path, block in blocks.items():
        block.register_forward_hook(lambda *_, path=path: calls.__setitem__(path, calls[path] + 1))
    model(**batch)
    assert calls == dict.fromkeys(blocks, 1)
    owned = [id(p) for block in blocks.values() for p in block.parameters()]
    tied = ZOO[name].decoder is not None and ZOO[name].decoder.tie_embeddings  # embed and head hold one Parameter
    assert len(owned) - len(set(owned)) == (1 if tied else 0)
    assert set(owned) == {id(p) for p in model.parameters()}


def test_tiny_vlm_block_names():
    model, _ = build_tiny("tiny-vlm")
    assert [name for name, _ in model.named_children()] == ["vision", "vision_proj", "llm"]
    blocks = set(block_paths(model))
    expected = {"vision.patch_embed", "vision.layers.0", "vision.norm", "vision_proj", "llm.embed", "llm.layers.1"}
    assert expected | {"llm.norm", "llm.head"} <= blocks
    assert type(model.llm.layers[0]).supports_tensor_parallel


@pytest.mark.parametrize("name", TINY)
def test_tiny_forward_backward_under_100ms_on_one_thread(name):
    model, batch = build_tiny(name)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model(**batch).backward()  # warm-up
        times = []
        for _ in range(5):
            start = time.perf_counter()
            model(**batch).backward()
            times.append(time.perf_counter() - start)
    finally:
        torch.set_num_threads(threads)
    assert statistics.median(times) < 0.1


def test_tiny_vlm_heavy_vision_costs_over_5x_the_llm():
    model, batch = build_tiny("tiny-vlm-heavy")
    with FlopCounterMode(display=False) as vision_counter:
        model.encode_images(batch["images"])
    with FlopCounterMode(display=False) as total_counter:
        model(**batch)
    vision = vision_counter.get_total_flops()
    assert vision >= 5 * (total_counter.get_total_flops() - vision)


def test_flamingo_vision_features_reach_several_decoder_layers():
    model, batch = build_tiny("tiny-flamingo")
    contexts = {}
    for i, layer in enumerate(model.llm.layers):
        if layer.cross is not None:
            layer.cross.register_forward_hook(lambda _m, args, _out, i=i: contexts.__setitem__(i, args[1]))
    features = model.encode_images(batch["images"])
    model(**batch).backward()
    assert len(contexts) >= 2
    assert all(torch.equal(context, features) for context in contexts.values())
    for i in contexts:
        assert model.llm.layers[i].cross.attn.wk.weight.grad.abs().sum() > 0
    assert model.vision.patch_embed.proj.weight.grad.abs().sum() > 0
    assert sum(isinstance(m, GatedCrossAttention) for m in model.modules()) == len(contexts)


def test_clip_towers_meet_only_at_the_head():
    model, batch = build_tiny("tiny-clip")
    image_side = {id(m) for name in ("image_tower", "image_proj") for m in getattr(model, name).modules()}
    text_side = {id(m) for name in ("text_tower", "text_proj") for m in getattr(model, name).modules()}
    assert not image_side & text_side
    image_params = {id(p) for name in ("image_tower", "image_proj") for p in getattr(model, name).parameters()}
    text_params = {id(p) for name in ("text_tower", "text_proj") for p in getattr(model, name).parameters()}
    assert not image_params & text_params

    outputs = {}
    for name in ("image_proj", "text_proj"):
        getattr(model, name).register_forward_hook(lambda _m, _a, out, name=name: outputs.__setitem__(name, out))
    model(**batch)
    first = dict(outputs)
    model(images=torch.randn_like(batch["images"]), tokens=batch["tokens"])
    assert torch.equal(outputs["text_proj"], first["text_proj"])
    assert not torch.equal(outputs["image_proj"], first["image_proj"])
    model(images=batch["images"], tokens=(batch["tokens"] + 1) % ZOO["tiny-clip"].clip.vocab)
    assert torch.equal(outputs["image_proj"], first["image_proj"])


@pytest.mark.parametrize("name", REAL)
def test_real_size_parameter_count_matches_published(name):
    with FakeTensorMode():
        model, batch = build(name)
    params = sum(p.numel() for p in model.parameters())
    assert params == pytest.approx(PUBLISHED_PARAMS[name] * 1e9, rel=0.03)
    assert resolve(name).seq_len == 2048
    assert batch["tokens"].shape == (1, ZOO[name].decoder.text_seq)


def test_llava_7b_forward_backward_under_fake_tensors():
    with FakeTensorMode():
        model, batch = build("llava-1.5-7b", micro_batch=2, dtype=torch.bfloat16)
        loss = model(**batch)
        loss.backward()
    assert loss.shape == () and loss.dtype == torch.bfloat16
    assert batch["images"].shape == (2, 3, 336, 336) and batch["images"].dtype == torch.bfloat16
    assert model.vision.layers[0].attn.wq.weight.grad.shape == (1024, 1024)


def test_builds_on_the_meta_device():
    with torch.device("meta"):
        model, batch = build("tiny-avlm")
        loss = model(**batch)
    assert loss.is_meta and all(p.is_meta for p in model.parameters())


def test_resolve_unknown_name_lists_the_known_ones():
    with pytest.raises(ValueError, match="tiny-vlm, tiny-avlm"):
        resolve("llava-42b")


def test_resolve_passes_a_config_through():
    assert resolve(ZOO["tiny-clip"]) is ZOO["tiny-clip"]


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: DecoderConfig(type="llama", hidden=100, layers=2, heads=3, vocab=8, text_seq=4), "hidden=100"),
        (
            lambda: DecoderConfig(type="llama", hidden=64, layers=2, heads=4, kv_heads=3, vocab=8, text_seq=4),
            "kv_heads=3",
        ),
        (lambda: DecoderConfig(type="bert", hidden=64, layers=2, heads=4, vocab=8, text_seq=4), "'bert'"),
        (lambda: DecoderConfig(type="gpt", hidden=64, layers=0, heads=4, vocab=8, text_seq=4), "layers.*0"),
        (lambda: VisionConfig(image_size=30, patch=8, hidden=64, layers=1, heads=4), "image_size=30"),
        (lambda: ArchConfig(name="x", vision=ZOO["tiny-vlm"].vision), "decoder"),
    ],
)
def test_invalid_configs_raise_naming_the_field(make, message):
    with pytest.raises(ValueError, match=message):
        make()

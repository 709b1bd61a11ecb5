"""Tests of architecture TOML parsing: the examples build, mistakes raise ValueError naming the problem."""

from pathlib import Path

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from runtime.models import GPTDecoder, build, load_arch_toml, resolve

EXAMPLES = Path(__file__).parents[2] / "runtime" / "models" / "examples"

SMALL_LM = """
[decoder]
type = "llama"
hidden = 32
layers = 1
heads = 2
vocab = 64
text_seq = 8
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "arch.toml"
    path.write_text(text)
    return path


def test_gpt3_example_has_published_parameter_count():
    arch = resolve(EXAMPLES / "gpt3-2.7b.toml")
    assert (arch.name, arch.kind, arch.dtype, arch.seq_len) == ("gpt3-2.7b", "lm", "bf16", 2048)
    with FakeTensorMode():
        model, batch = build(arch)
    assert isinstance(model.llm, GPTDecoder)
    assert model.llm.head.weight is model.llm.embed.tokens.weight
    # GPT-3 2.7B (Brown et al. 2020, Table 2.1): 2.7 B nominal; 2.65 B with the tied embedding.
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(2.65e9, rel=0.03)
    assert set(batch) == {"tokens", "targets"}


def test_small_vision_example_trains_on_cpu():
    arch = load_arch_toml(EXAMPLES / "small-vlm-gpt.toml")
    assert arch.vision.class_token and arch.projector.hidden == 128 and arch.seq_len == 16 + 16
    torch.manual_seed(0)
    model, batch = build(str(EXAMPLES / "small-vlm-gpt.toml"), micro_batch=2)
    loss = model(**batch)
    loss.backward()
    assert torch.isfinite(loss)
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


def test_defaults_fill_name_dtype_kv_heads_and_mlp(tmp_path):
    arch = load_arch_toml(write(tmp_path, SMALL_LM))
    assert (arch.name, arch.dtype) == ("arch", "fp32")
    assert (arch.decoder.kv_heads, arch.decoder.mlp) == (2, 256)


@pytest.mark.parametrize(
    "text, message",
    [
        (SMALL_LM + "hiden = 3\n", r"\[decoder\] unknown key\(s\) hiden"),
        ("[encoder]\nhidden = 3\n" + SMALL_LM, "unknown top-level key.*encoder"),
        ("layers = 3\n" + SMALL_LM, "unknown top-level key.*layers"),
        (
            '[decoder]\ntype = "gpt"\nhidden = 32\nlayers = 1\n',
            r"\[decoder\] missing required key\(s\): heads, vocab, text_seq",
        ),
        ("[decoder\ntype = 1\n", "invalid|Expected"),
        (SMALL_LM.replace("heads = 2", 'heads = "two"'), "DecoderConfig.heads.*'two'"),
        ('dtype = "fp16"\n' + SMALL_LM, "dtype.*'fp16'"),
        ("decoder = 3\n", r"\[decoder\] must be a table"),
        (SMALL_LM + "[projector]\nmerge = 2\n", r"\[projector\] given without \[vision\]"),
        ("[clip]\nembed_dim = 8\n", r"\[clip\] missing required key"),
    ],
)
def test_malformed_toml_raises_value_error_naming_the_problem(tmp_path, text, message):
    with pytest.raises(ValueError, match=message):
        load_arch_toml(write(tmp_path, text))

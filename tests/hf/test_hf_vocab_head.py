"""One truth for the LM head under tensor parallelism: the profile marks a block vocab_parallel="head" exactly
when the runtime shards it over the vocabulary — for models run by their own forward (Hugging Face) and for
fx-traced ones (runtime/vocab_parallel.HeadPaths, shard_head)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from planner.profiler.profile import profile_model
from runtime.forward_program import ForwardProgram
from runtime.program import block_modules, trace_program
from runtime.source import call_factory, resolve
from runtime.vocab_parallel import _loss_node
from tests.hf import tiny_configs

V = 16


class TinyLM(nn.Module):
    def __init__(self, extra_read: bool):
        super().__init__()
        self.extra_read = extra_read
        self.layers = nn.ModuleList([nn.Embedding(V, 8), nn.Linear(8, 8)])
        self.head = nn.Linear(8, V)

    def forward(self, tokens, targets):
        logits = self.head(self.layers[1](self.layers[0](tokens)))
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        return loss + logits.pow(2).mean() if self.extra_read else loss  # glue reading the logits: no sharding


def plain():
    return TinyLM(False), {"tokens": torch.randint(V, (1, 4)), "targets": torch.randint(V, (1, 4))}


def reads_logits():
    return TinyLM(True), {"tokens": torch.randint(V, (1, 4)), "targets": torch.randint(V, (1, 4))}


def _heads(spec: str) -> tuple[set[str], set[str], set[str]]:
    """(profile's heads, own-forward runtime's heads, fx runtime's heads or the own-forward ones when no fx)."""
    prof = profile_model(resolve(spec))
    priced = {b.name for b in prof.blocks if b.vocab_parallel == "head"}
    model, example = call_factory(resolve(spec), 1)
    blocks = block_modules(model)
    own = ForwardProgram(model, example, blocks).vocab_heads
    program = trace_program(model, example)
    fx = own if hasattr(program, "vocab_heads") else {b for b in program.blocks if _loss_node(program, b) is not None
                                                       and type(blocks[b]) is nn.Linear}
    return priced, own, fx


@pytest.mark.parametrize("spec, want", [(f"{__name__}:plain", {"head"}), (f"{__name__}:reads_logits", set())])
def test_the_profile_prices_the_head_the_runtime_shards(spec, want):
    assert _heads(spec) == (want, want, want)


def test_hf_lm_head_is_vocabulary_parallel_in_profile_and_runtime(tmp_path):
    spec = f"hf:{tiny_configs.llava(tmp_path / 'llava')}"
    assert _heads(spec) == ({"lm_head"}, {"lm_head"}, {"lm_head"})

"""The model of `mmplan demo --case micro-batch` (`runtime.models.mb_vlm:factory`): a ViT of many narrow layers over
few patches beside a LLaMA decoder whose large vocabulary makes its loss memory-heavy per sample.

The two groups want opposite step shapes on a CPU rank. The encoder (12 layers of width 32 over 4 patches, 0.1 M
parameters) is host-bound: each layer dispatches ~40 aten ops forward and ~100 backward whatever its batch
(cost_models/catalog.py, local-cpu: ~6.5 us and ~4.2 us each), so its step costs about the same at 1 sample per
micro-batch as at 8 and it runs best with few, large micro-batches. The LLM is the opposite: its head's logits over
a 16k vocabulary for 64 text positions (64 x 16384 x 4 bytes = 4 MB per sample, kept for the cross-entropy's
backward, with their gradient and the log-softmax beside them) make its saved activations grow with every sample
of a micro-batch, so under the demo cluster's memory cap (micro_batch_cluster.toml) it runs one sample per replica
at a time (two with its Adam state on the host and its head recomputed) -- and a one-layout plan must run the
encoder so too, paying its dispatch 4 to 8 times per step."""
from __future__ import annotations

from .build import build_model, example_batch
from .configs import ArchConfig, DecoderConfig, VisionConfig

ARCH = ArchConfig(
    name="mb-vlm",
    vision=VisionConfig(image_size=16, patch=8, hidden=32, layers=16, heads=2, mlp=64),  # 4 patches per image
    decoder=DecoderConfig(type="llama", hidden=16, layers=2, heads=2, vocab=4096, text_seq=256),
)


def factory(micro_batch: int = 1):
    """(model, example batch): model(**batch) is the scalar loss."""
    return build_model(ARCH), example_batch(ARCH, micro_batch)

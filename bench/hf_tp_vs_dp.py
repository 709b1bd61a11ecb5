"""tp2 vs dp2 for a small stock Hugging Face LLaVA (4-layer Llama 512 wide, vocabulary 4096; 2-layer CLIP tower) on
2 local gloo ranks: the cost model's predicted step time and the measured median step time of each plan
(runs interleaved, steps 0-1 dropped). TP from the model's own base_model_tp_plan, the embedding and the LM head
vocabulary-parallel. Prints the load average before each run: on a shared machine the numbers move with it.

    PYTHONPATH=$PWD python bench/hf_tp_vs_dp.py [ROUNDS]
"""
from __future__ import annotations

import os
import statistics
import sys
import tempfile
from pathlib import Path


def main(rounds: int) -> None:
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig

    from cost_models.pipeline import simulate
    from runtime.launch import launch
    from runtime.train import Job, train_rank
    from tests.runtime.plan_builder import make_plan, profile

    d = Path(tempfile.mkdtemp()) / "llava-m"
    vision = CLIPVisionConfig(hidden_size=128, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                              image_size=32, patch_size=8, projection_dim=128)
    text = LlamaConfig(hidden_size=512, intermediate_size=2048, num_hidden_layers=4, num_attention_heads=8,
                       num_key_value_heads=8, vocab_size=4096, max_position_embeddings=512)
    config = LlavaConfig(vision_config=vision, text_config=text, image_token_index=4095, image_seq_length=16,
                         architectures=["LlavaForConditionalGeneration"])
    config.mmplan_inputs = {"text_tokens": 112}
    config.save_pretrained(d)
    model, blocks = f"hf:{d}", ["model", "lm_head"]
    plans = {name: make_plan(model, [{"name": "all", **g, "stages": [(blocks, [0, 1])]}], global_batch=8, micro_batches=2)
             for name, g in {"dp2": {"dp": 2}, "tp2": {"tp": 2}}.items()}
    prof = profile(model)
    predicted = {name: simulate(plan, prof).step_time_s for name, plan in plans.items()}
    times: dict[str, list[float]] = {name: [] for name in plans}
    for r in range(rounds):
        for name, plan in plans.items():
            load = os.getloadavg()[0]
            res = launch(train_rank, 2, Job(plan=plan, model=model, steps=8, seed=0), timeout_s=600)
            steps = [m["step_time_s"] for m in res[0]["metrics"]][2:]
            times[name] += steps
            print(f"{name} round {r}: load {load:.2f}, median step {statistics.median(steps):.3f} s", flush=True)
    for name in plans:
        print(f"{name}: predicted {predicted[name]:.3f} s, measured median {statistics.median(times[name]):.3f} s")
    print(f"tp2 speed-up over dp2: predicted {predicted['dp2'] / predicted['tp2']:.2f}x, "
          f"measured {statistics.median(times['dp2']) / statistics.median(times['tp2']):.2f}x")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 2)

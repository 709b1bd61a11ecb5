"""Benchmark (issue 31's table): twelve Hugging Face families, from full-size configs written here (random
weights, nothing downloaded) and tiny ones (tests/hf).

Per family: the groups the profile finds; the meta profile's wall / CPU seconds and peak RSS at full size (a
fresh process each, importing transformers counted; target < 60 s, < 4 GB); the plans `solve` finds colocated
and non-colocated on 16 H100s (predicted step time); and, on the tiny config, whether runs of four plans match
the single-process reference step by step (losses within 1e-4 relative): dp2, pp2 (blocks cut in half,
4 micro-batches), non-colocated (every group before the last on rank 0, the last -- the LLM -- on rank 1) and
dp2 with ZeRO-1. Needs transformers (pip install -e ".[hf]").
Run: python bench/hf_families_bench.py [--families llava,whisper] [--no-solve] [--no-runs] [--steps 4]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
TARGET_S, TARGET_BYTES = 60.0, 4e9
_LLAMA7 = {"hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32,
           "num_key_value_heads": 32, "vocab_size": 32064, "max_position_embeddings": 4096}
_CLIP_L = {"hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 24, "num_attention_heads": 16,
           "image_size": 336, "patch_size": 14, "projection_dim": 768}
_SO400M = {"hidden_size": 1152, "intermediate_size": 4304, "num_hidden_layers": 27, "num_attention_heads": 16,
           "patch_size": 14}
_QWEN7 = {"hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28,
          "num_key_value_heads": 4, "vocab_size": 152064, "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]}}
_LLAMA3_8 = {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
             "num_key_value_heads": 8, "vocab_size": 128259}


def _full(family: str):
    """The full-size config of a family (published sizes of the model named in the table)."""
    import transformers as t

    bf16 = {"dtype": "bfloat16"}
    if family == "llava":  # llava-1.5-7b
        return t.LlavaConfig(vision_config={**_CLIP_L, "model_type": "clip_vision_model"}, text_config={**_LLAMA7, "model_type": "llama"},
                             image_token_index=32000, **bf16)
    if family == "llava_next":  # llava-v1.6-mistral-7b
        text = {**_LLAMA7, "model_type": "mistral", "intermediate_size": 14336, "num_key_value_heads": 8}
        return t.LlavaNextConfig(vision_config={**_CLIP_L, "model_type": "clip_vision_model"}, text_config=text,
                                 image_token_index=32000, image_grid_pinpoints=[[336, 672], [672, 336], [672, 672]], **bf16)
    if family == "qwen2_vl":  # Qwen2-VL-7B
        return t.Qwen2VLConfig(text_config=_QWEN7, vision_config={"depth": 32, "embed_dim": 1280, "hidden_size": 3584,
                               "num_heads": 16, "mlp_ratio": 4}, **bf16)
    if family == "qwen2_5_vl":  # Qwen2.5-VL-7B
        return t.Qwen2_5_VLConfig(text_config=_QWEN7, vision_config={"depth": 32, "hidden_size": 1280, "intermediate_size": 3420,
                                  "num_heads": 16, "out_hidden_size": 3584, "fullatt_block_indexes": [7, 15, 23, 31]}, **bf16)
    if family == "qwen2_audio":  # Qwen2-Audio-7B
        return t.Qwen2AudioConfig(audio_config={"d_model": 1280, "encoder_layers": 32, "encoder_attention_heads": 20,
                                  "encoder_ffn_dim": 5120, "num_mel_bins": 128, "max_source_positions": 1500},
                                  text_config={**_LLAMA7, "model_type": "qwen2", "vocab_size": 156032}, audio_token_index=151646, **bf16)
    if family == "paligemma":  # paligemma-3b-pt-224
        text = {"model_type": "gemma", "hidden_size": 2048, "intermediate_size": 16384, "num_hidden_layers": 18,
                "num_attention_heads": 8, "num_key_value_heads": 1, "head_dim": 256, "vocab_size": 257216}
        return t.PaliGemmaConfig(vision_config={**_SO400M, "model_type": "siglip_vision_model", "image_size": 224, "projection_dim": 2048},
                                 text_config=text, image_token_index=257152, projection_dim=2048, hidden_size=2048, **bf16)
    if family == "gemma3":  # gemma-3-4b
        text = {"hidden_size": 2560, "intermediate_size": 10240, "num_hidden_layers": 34, "num_attention_heads": 8,
                "num_key_value_heads": 4, "head_dim": 256, "vocab_size": 262208, "sliding_window": 1024}
        return t.Gemma3Config(vision_config={**_SO400M, "model_type": "siglip_vision_model", "image_size": 896}, text_config=text,
                              mm_tokens_per_image=256, **bf16)
    if family == "idefics3":  # Idefics3-8B-Llama3
        return t.Idefics3Config(vision_config={**_SO400M, "image_size": 364}, text_config={**_LLAMA3_8, "model_type": "llama"},
                                image_token_id=128257, scale_factor=2, **bf16)
    if family == "mllama":  # Llama-3.2-11B-Vision
        return t.MllamaConfig(vision_config={"image_size": 560}, text_config={}, **bf16)
    if family == "blip2":  # blip2-opt-2.7b
        return t.Blip2Config(vision_config={"hidden_size": 1408, "intermediate_size": 6144, "num_hidden_layers": 39, "num_attention_heads": 16},
                             qformer_config={"encoder_hidden_size": 1408},
                             text_config={"model_type": "opt", "hidden_size": 2560, "ffn_dim": 10240, "num_hidden_layers": 32,
                                          "num_attention_heads": 32, "vocab_size": 50272, "word_embed_proj_dim": 2560},
                             num_query_tokens=32, image_token_index=50265)
    if family == "internvl":  # InternVL3-8B
        return t.InternVLConfig(vision_config={"hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 24,
                                "num_attention_heads": 16, "image_size": [448, 448], "patch_size": [14, 14]},
                                text_config={**_QWEN7, "model_type": "qwen2", "vocab_size": 151674, "rope_scaling": None},
                                image_token_id=151667, image_seq_length=256, downsample_ratio=0.5, **bf16)
    if family == "whisper":  # whisper-large-v3
        return t.WhisperConfig(d_model=1280, encoder_layers=32, decoder_layers=32, encoder_attention_heads=20,
                               decoder_attention_heads=20, encoder_ffn_dim=5120, decoder_ffn_dim=5120, num_mel_bins=128,
                               vocab_size=51866, **bf16)
    raise KeyError(family)


ARCH = {"llava": "LlavaForConditionalGeneration", "llava_next": "LlavaNextForConditionalGeneration",
        "qwen2_vl": "Qwen2VLForConditionalGeneration", "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
        "qwen2_audio": "Qwen2AudioForConditionalGeneration", "paligemma": "PaliGemmaForConditionalGeneration",
        "gemma3": "Gemma3ForConditionalGeneration", "idefics3": "Idefics3ForConditionalGeneration",
        "mllama": "MllamaForConditionalGeneration", "blip2": "Blip2ForConditionalGeneration",
        "internvl": "InternVLForConditionalGeneration", "whisper": "WhisperForConditionalGeneration"}
FAMILIES = tuple(ARCH)

CHILD = """
import json, resource, sys, time
t0 = time.perf_counter()
from runtime.source import resolve
from planner.profiler.profile import profile_model
from plans.graph import save_profile
p = profile_model(resolve(sys.argv[1]), device="meta")
save_profile(p, sys.argv[2])
usage = resource.getrusage(resource.RUSAGE_SELF)
print(json.dumps({"wall_s": time.perf_counter() - t0, "cpu_s": usage.ru_utime + usage.ru_stime,
                  "rss_bytes": usage.ru_maxrss * 1024, "params": sum(b.params for b in p.blocks), "groups": list(p.groups)}))
"""


def profile_full(family: str, root: Path) -> dict:
    config = _full(family)
    config.architectures = [ARCH[family]]
    config.save_pretrained(root / family)
    out = subprocess.run([sys.executable, "-c", CHILD, f"hf:{root / family}", str(root / f"{family}.json")],
                         capture_output=True, text=True, cwd=ROOT, timeout=900)
    if out.returncode:
        return {"error": (out.stderr.strip().splitlines() or ["?"])[-1][:120]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def solve(profile: Path, placement: str, time_limit: int) -> str:
    out = subprocess.run([sys.executable, "-m", "planner.cli", "solve", str(profile), "--cluster", "16xh100-sxm",
                          "--global-batch", "128", "--placement", placement, "--time-limit", str(time_limit), "--json",
                          "-o", str(profile.with_suffix(f".{placement}.plan.json"))],
                         capture_output=True, text=True, cwd=ROOT, timeout=600)
    if out.returncode:
        return "no: " + (out.stderr.strip().splitlines() or ["?"])[-1][:60]
    data = json.loads(out.stdout)
    groups = "+".join(f"{g['name']}:{g['gpus']}" for g in data["groups"])  # the winner may be a baseline's one group
    return f"{data['step_time_s'] * 1e3:.0f} ms ({groups})"


def _tiny(family: str, root: Path) -> str:
    from tests.hf import tiny_configs, tiny_families

    make = getattr(tiny_families, family, None) or getattr(tiny_configs, family)
    return f"hf:{make(root / ('tiny-' + family))}"


def _plans(spec: str) -> dict[str, tuple[list, dict]]:
    from tests.runtime.plan_builder import profile

    blocks = [b.name for b in profile(spec).blocks]
    groups = list(dict.fromkeys(b.group for b in profile(spec).blocks))
    last = [b.name for b in profile(spec).blocks if b.group == groups[-1]]
    half = len(blocks) // 2
    return {
        "dp2": ([{"name": "all", "dp": 2, "stages": [(blocks, [0, 1])]}], {}),
        "pp2": ([{"name": "all", "stages": [(blocks[:half], [0]), (blocks[half:], [1])]}], {"micro_batches": 4}),
        "non-colocated": ([{"name": "towers", "stages": [([b for b in blocks if b not in last], [0])]},
                           {"name": "llm", "stages": [(last, [1])]}], {}),
        "zero1": ([{"name": "all", "dp": 2, "zero": 1, "stages": [(blocks, [0, 1])]}], {}),
    }


def run_parity(spec: str, steps: int) -> dict[str, str]:
    from runtime.launch import launch
    from runtime.reference import reference_run
    from runtime.train import Job, train_rank
    from tests.runtime.plan_builder import make_plan

    out = {}
    for name, (groups, training) in _plans(spec).items():
        try:
            plan = make_plan(spec, groups, **training)
            job = Job(plan=plan, model=spec, steps=steps, seed=0)
            want = reference_run(job)["losses"]
            got = [m["loss"] for m in launch(train_rank, plan.world_size, job, timeout_s=300)[0]["metrics"]]
            worst = max(abs(g - w) / abs(w) for g, w in zip(got, want))
            out[name] = f"{worst:.0e}" if worst <= 1e-4 else f"OFF {worst:.0e}"
        except Exception as e:  # noqa: BLE001 - a row of the table, not a crash
            out[name] = f"fail: {type(e).__name__}: {' '.join(str(e).split())[:60]}"
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--no-solve", action="store_true")
    ap.add_argument("--no-runs", action="store_true")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--time-limit", type=int, default=20)
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for family in args.families.split(","):
            t0 = time.perf_counter()
            row = {"family": family, **profile_full(family, root)}
            if not args.no_solve and "error" not in row:
                row["colocated"] = solve(root / f"{family}.json", "colocated", args.time_limit)
                row["non-colocated"] = solve(root / f"{family}.json", "non-colocated", args.time_limit)
            if not args.no_runs:
                row["runs"] = run_parity(_tiny(family, root), args.steps)
            rows.append(row)
            print(json.dumps(row), f"({time.perf_counter() - t0:.0f} s)", flush=True)
    print_table(rows)
    return 0


def print_table(rows: list[dict]) -> None:
    print(f"\n| family | groups (full size) | params | meta s (wall/cpu) | peak RSS | colocated | non-colocated | "
          "dp2 | pp2 | non-coloc. | ZeRO-1 |")
    print("|" + "---|" * 11)
    for r in rows:
        runs = r.get("runs", {})
        if "error" in r:
            prof = [r["error"], "", "", ""]
        else:
            ok = "" if r["wall_s"] < TARGET_S and r["rss_bytes"] < TARGET_BYTES else " (over target)"
            prof = [", ".join(r["groups"]), f"{r['params'] / 1e9:.1f} B", f"{r['wall_s']:.0f}/{r['cpu_s']:.0f}{ok}",
                    f"{r['rss_bytes'] / 2**30:.2f} GiB"]
        cells = [r["family"], *prof, r.get("colocated", "-"), r.get("non-colocated", "-"),
                 *(runs.get(k, "-") for k in ("dp2", "pp2", "non-colocated", "zero1"))]
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    raise SystemExit(main())

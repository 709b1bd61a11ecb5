"""Stock transformers models profiled as they are: hf:CONFIG, meta without environment variables, modality groups."""
from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from planner.cli import app
from planner.profiler.profile import profile_model
from plans.errors import MmplanError
from plans.graph import load_profile
from runtime.source import resolve
from tests.cli_helpers import one_line_error
from tests.hf import tiny_configs


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    return f"hf:{tiny_configs.llava(tmp_path_factory.mktemp('llava'))}"


def _groups(profile) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for b in profile.blocks:
        out.setdefault(b.group, []).append(b.name)
    return out


def test_llava_on_meta_groups_by_modality_at_any_depth(llava):
    prof = profile_model(resolve(llava), device="meta")
    groups = _groups(prof)
    assert list(groups) == ["vision", "projector", "llm"]  # contiguous, in data-flow order
    assert all(b.startswith("model.vision_tower.") for b in groups["vision"])
    assert groups["projector"] == ["model.multi_modal_projector"]
    assert groups["llm"][0] == "model.language_model.embed_tokens" and groups["llm"][-1] == "lm_head"
    assert not any("rotary_emb" in b.name for b in prof.blocks)  # parameter-free helpers are glue
    # LLaVA reads the second-to-last vision layer: the projector's input edge says so
    assert [(e.src, e.dst) for e in prof.edges if e.dst == "model.multi_modal_projector"] == \
        [("model.vision_tower.encoder.layers.0", "model.multi_modal_projector")]
    assert prof.loss == ("lm_head",)


def test_measure_on_cpu_matches_meta(llava):
    meta = profile_model(resolve(llava), device="meta")
    cpu = profile_model(resolve(llava), device="cpu", measure=True, reps=1)
    assert cpu.fingerprint == meta.fingerprint
    for a, b in zip(meta.blocks, cpu.blocks):
        assert (a.name, a.group, a.activation_bytes, a.fwd_flops) == (b.name, b.group, b.activation_bytes, b.fwd_flops)
        assert b.fwd_ms is not None and b.fwd_ms >= 0


def test_group_overrides_are_stored_and_a_pattern_matching_nothing_is_an_error(llava, tmp_path):
    prof = profile_model(resolve(llava), groups=[("projector", "vision")])  # a pattern may name a whole group
    assert list(_groups(prof)) == ["vision", "llm"]
    assert prof.options.groups == (("projector", "vision"),)
    res = CliRunner().invoke(app, ["profile", llava, "-o", str(tmp_path / "p.json"), "--group", "model.merger*=projector"])
    assert "matches no block" in one_line_error(res)
    assert not (tmp_path / "p.json").exists()


def test_qwen2_audio_and_qwen2_vl_profile_on_meta(tmp_path):
    audio = profile_model(resolve(f"hf:{tiny_configs.qwen2_audio(tmp_path / 'a')}"))
    assert list(_groups(audio)) == ["audio", "projector", "llm"]
    vl = profile_model(resolve(f"hf:{tiny_configs.qwen2_vl(tmp_path / 'v')}"))
    groups = _groups(vl)
    assert list(groups) == ["vision", "projector", "llm"]
    assert all(b.startswith("model.visual.merger") for b in groups["projector"])  # the merger, inside the tower


def test_bad_hf_specs_are_one_line_errors(tmp_path):
    with pytest.raises(MmplanError, match="no such config.json"):
        resolve(f"hf:{tmp_path / 'nothing'}")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llava"}))
    with pytest.raises(MmplanError, match="architectures"):
        resolve(f"hf:{tmp_path}")


def test_a_factory_may_return_a_bare_hf_model():
    prof = profile_model(resolve("examples.hf_model:factory"))
    assert list(_groups(prof)) == ["vision", "projector", "llm"]


def test_cli_profile_and_show(llava, tmp_path):
    out = tmp_path / "p.json"
    res = CliRunner().invoke(app, ["profile", llava, "-o", str(out), "--quiet"])
    assert res.exit_code == 0, res.output
    assert list(load_profile(out).groups) == ["vision", "projector", "llm"]
    res = CliRunner().invoke(app, ["show", str(out)])
    assert res.exit_code == 0 and "model.vision_tower" in res.output and "model.multi_modal_projector" in res.output


def test_clip_profiles_on_meta_with_its_towers_as_groups(tmp_path):
    prof = profile_model(resolve(f"hf:{tiny_configs.clip(tmp_path / 'c')}"))
    assert list(_groups(prof)) == ["vision_model", "visual_projection", "text_model", "text_projection"]
    assert set(prof.loss) == {"visual_projection", "text_projection"}  # the contrastive loss reads both towers

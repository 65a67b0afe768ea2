"""Hugging Face ``transformers`` as a model source (sky_flower/pipeline/hf.py): the Hydra
group ``model=hf``, a local ``save_pretrained`` directory as the base, and the trained
weights back under the ``transformers`` model's own keys (nothing downloaded)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from sky_flower.jobs.common import conf_dir
from sky_flower.pipeline.hf import hf_module, hf_sequential, pretrained_state_dict
from sky_flower.pipeline.models import build_model

CONF = Path(conf_dir())  # registers the settings' defaults (sky_base) to compose
QWEN = {
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 32,
    "tie_word_embeddings": False,
}


def test_model_hf_config_builds_a_split_llama_on_the_lm_task():
    with initialize_config_dir(str(CONF), version_base=None):
        cfg = compose("config", overrides=["model=hf", "model.config.num_hidden_layers=2"])
    assert cfg.objective.loss.endswith("lm_cross_entropy") and cfg.dataset.name == "pysource"
    model = build_model(OmegaConf.to_container(cfg.model, resolve=True))
    # embeddings | layer 0 | layer 1 | norm | head
    assert model.split_points == [
        "hf.model.layers.0",
        "hf.model.layers.1",
        "hf.model.norm",
        "hf.lm_head",
    ]
    ids = torch.randint(0, 256, (2, cfg.model.seq_len))
    assert model(ids).shape == (2, cfg.model.seq_len, 256)


def test_trained_weights_round_trip_through_save_pretrained(tmp_path):
    """A converted model's weights (changed as training would) load strictly into the
    transformers model, save_pretrained writes them, and a conversion of
    model.pretrained=<that directory> starts from exactly them."""
    seq = hf_sequential([8], config_class="Qwen2Config", config=QWEN)
    with torch.no_grad():
        for p in seq.parameters():
            p.add_(0.01)
    base = hf_module("Qwen2Config", QWEN).hf
    base.load_state_dict(pretrained_state_dict(seq.state_dict(), like=base), strict=True)
    base.save_pretrained(tmp_path)
    again = hf_sequential([8], pretrained=str(tmp_path))
    assert again.state_dict().keys() == seq.state_dict().keys()
    for key, value in seq.state_dict().items():
        assert torch.equal(again.state_dict()[key], value), key


def test_bad_sources_are_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match="no transformers config class"):
        hf_module("NoSuchConfig", {})
    with pytest.raises(ValueError, match="is no directory"):
        hf_module(pretrained=str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="config_class .* or model.pretrained"):
        hf_module()
    with pytest.raises(ValueError, match="unknown task"):
        hf_module("LlamaConfig", {}, task="translation")


def test_a_tied_head_is_named_with_the_config_key_that_unties_it():
    cfg = {**QWEN, "tie_word_embeddings": True}
    with pytest.warns(UserWarning, match="tie_word_embeddings=False"):
        seq = hf_sequential([8], config_class="Qwen2Config", config=cfg)
    assert len(seq) == 1


def test_a_raw_transformers_model_is_refused_naming_the_wrapper():
    """Its forward returns a ModelOutput, not the loss's input."""
    from sky_flower.pipeline.graph import sequential_of

    raw = hf_module("Qwen2Config", QWEN).hf
    with pytest.raises(ValueError, match=r"returns CausalLMOutputWithPast.*hf_sequential"):
        sequential_of(raw, [8], "int64")


class T5Encoder(torch.nn.Module):
    """A tiny T5 encoder as ``ids (B, T) -> hidden states``: ``shared`` and
    ``encoder.embed_tokens`` are one tensor, and block 0 makes the position bias every
    later block reads."""

    def __init__(self, num_layers: int):
        super().__init__()
        import transformers

        cfg = transformers.T5Config(
            vocab_size=64, d_model=16, d_kv=4, d_ff=32, num_layers=num_layers, num_heads=4
        )
        self.m = transformers.T5EncoderModel(cfg)

    def forward(self, ids):
        return self.m(input_ids=ids).last_hidden_state


def test_aliased_weights_come_back_under_every_key():
    """T5's encoder reads ``shared`` as ``encoder.embed_tokens``: one tensor, two keys of
    the module's state dict; the converted model holds it once."""
    from sky_flower.pipeline.graph import original_state_dict, sequential_of

    torch.manual_seed(0)
    model = T5Encoder(num_layers=2)
    with pytest.warns(UserWarning, match="no cut before m.encoder.block.1"):  # (below)
        seq = sequential_of(model, [8], "int64")
    state = original_state_dict(seq.state_dict(), like=model)
    assert list(state) == list(model.state_dict())
    assert torch.equal(state["m.shared.weight"], state["m.encoder.embed_tokens.weight"])
    model.load_state_dict(state, strict=True)


def test_stages_of_a_transformers_model_build_where_the_meta_device_cannot_run_it():
    """Building a stage (and the direct transport's static shapes) starts on the meta
    device; a transformers forward calls .item() on its mask there, so the converted
    model is built on the CPU instead (model=hf failed on every node before)."""
    from sky_flower.pipeline.local import stage_input_shapes
    from sky_flower.pipeline.stage import build_stage, slice_state

    def model_fn():
        return hf_sequential([8], config_class="Qwen2Config", config=QWEN)

    with pytest.raises(ValueError, match="cannot be called on meta tensors"):
        with torch.device("meta"):  # another config: not from the process's cache
            hf_sequential([8], config_class="Qwen2Config", config={**QWEN, "rope_theta": 1e4})
    full = model_fn()
    stage = build_stage(model_fn, 1, 3, slice_state(full.state_dict(), 1, 3))
    assert [k for k in stage.state_dict()] == [
        k for k in full.state_dict() if k.split(".")[0] in {"1", "2", "3"}
    ]
    assert stage_input_shapes(model_fn, [8], [(0, 1), (2, 4)], "int64") == [(8,), (8, 32)]


def test_a_cut_a_batchless_value_crosses_is_dropped_with_a_warning():
    """T5's position bias (1, heads, T, T) is made in block 0 from a trainable
    parameter and read by every later block: no cut between blocks can carry it into
    micro-batches, and the warning names the cut and the value (it was silent)."""
    from sky_flower.pipeline.graph import as_sequential

    with pytest.warns(UserWarning, match=r"no cut before m\.encoder\.block\.2 \(.*without a batch"):
        seq = as_sequential(
            T5Encoder(num_layers=3), torch.zeros(2, 8, dtype=torch.long), ["m.encoder.block.2"]
        )
    assert len(seq) == 1 and seq.split_points == []


def test_a_local_checkpoint_is_a_hydra_choice_of_its_own(tmp_path):
    """model=hf_pretrained model.pretrained=<dir> (a plain override, no '+')."""
    hf_module("Qwen2Config", {**QWEN, "vocab_size": 256}).hf.save_pretrained(tmp_path)
    with initialize_config_dir(str(CONF), version_base=None):
        cfg = compose("config", overrides=["model=hf_pretrained", f"model.pretrained={tmp_path}"])
    model = build_model(OmegaConf.to_container(cfg.model, resolve=True))
    assert model.split_points[-1] == "hf.lm_head" and len(model) == 5

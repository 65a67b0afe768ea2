"""Model profile: FLOPs from FlopCounterMode, bytes from real tensors."""

import pytest
import torch
from torch import nn

from sky_flower.core.profile import default_optimizer_factory, profile_layers, time_layers
from sky_flower.pipeline.models import build_model


def test_linear_flops_and_bytes():
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    prof = profile_layers(model, (8,), microbatch_size=5)
    assert [p.name for p in prof] == ["0:Linear", "1:ReLU", "2:Linear"]
    # forward: one multiply-add = 2 FLOPs per weight per sample
    assert prof[0].fwd_flops == 2 * 8 * 16
    assert prof[2].fwd_flops == 2 * 16 * 4
    # first layer: weight gradient only (input needs none); later: input + weight grads
    assert prof[0].bwd_flops == 2 * 8 * 16
    assert prof[2].bwd_flops == 2 * (2 * 16 * 4)
    assert prof[1].fwd_flops == 0 and prof[1].param_bytes == 0
    assert prof[0].param_bytes == (8 * 16 + 16) * 4
    assert prof[0].act_in_bytes == 8 * 4 and prof[0].act_out_bytes == 16 * 4
    assert prof[2].act_out_bytes == 4 * 4


@pytest.mark.parametrize(
    ("name", "per_param_copies"), [("adam", 2), ("sgd_momentum", 1), ("sgd", 0)]
)
def test_optimizer_state_bytes(name, per_param_copies):
    model = nn.Sequential(nn.Linear(10, 20))
    prof = profile_layers(model, (10,), 2, default_optimizer_factory(name))
    params = prof[0].param_bytes
    # Adam also keeps a float32 `step` per parameter tensor (2 tensors here).
    extra = 2 * 4 if name == "adam" else 0
    assert prof[0].optimizer_state_bytes == per_param_copies * params + extra


def test_profile_leaves_model_untouched():
    model = build_model({"name": "mlp", "hidden_width": 32, "hidden_layers": 2})
    before = {k: v.clone() for k, v in model.state_dict().items()}
    profile_layers(model, (64,), 4)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())


def test_bad_inputs():
    with pytest.raises(TypeError, match="nn.Sequential or a list"):
        profile_layers(nn.Linear(3, 3), (3,), 1)
    with pytest.raises(ValueError, match="does not accept input"):
        profile_layers(nn.Sequential(nn.Linear(3, 3)), (4,), 1)
    with pytest.raises(ValueError, match="unknown optimizer"):
        default_optimizer_factory("lamb")
    with pytest.raises(ValueError, match="unknown model"):
        build_model({"name": "resnet"})


def test_time_layers_shapes():
    model = build_model({"name": "mlp", "hidden_width": 64, "hidden_layers": 3})
    fwd, bwd = time_layers(model, (64,), 8, warmup=1, repeats=3)
    assert len(fwd) == len(bwd) == 4
    assert all(t > 0 for t in fwd) and all(t > 0 for t in bwd)

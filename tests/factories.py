"""Hand-made profiles for pure planner tests (no torch model needed)."""

from sky_flower.core.profile import LayerProfile


def fake_layer(index, param=0, opt=0, act_in=0.0, act_out=0.0):
    """A layer with the given bytes (FLOPs are irrelevant to the planner)."""
    return LayerProfile(
        index=index,
        name=f"{index}:Fake",
        fwd_flops=0.0,
        bwd_flops=0.0,
        param_bytes=param,
        optimizer_state_bytes=opt,
        act_in_bytes=act_in,
        act_out_bytes=act_out,
    )


def runner_settings(paths):
    """A runner test's ``SkySettings``: the values at the Hydra ``paths`` (checked, as
    ``SkySettings.replace`` checks them), replies polled without a pause
    (``messaging.poll_interval_s`` 0, below the setting's rule: in process only)."""
    import dataclasses

    from sky_flower.sky.settings import SkySettings

    s = SkySettings().replace(paths)
    return dataclasses.replace(s, messaging=dataclasses.replace(s.messaging, poll_interval_s=0.0))

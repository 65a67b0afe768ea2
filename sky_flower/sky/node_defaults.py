"""A Sky node's defaults for the simulation engine: its emulation and its data by partition.

Kept apart from :mod:`sky_flower.sky.client` (which re-exports them) so the handlers'
module stays about the protocol.
"""

from __future__ import annotations

from collections.abc import Callable

from flwr.app import Context

from sky_flower.emulation.devices import Emulation
from sky_flower.pipeline.data import Split


def default_emulation(context: Context) -> Emulation:
    """A native node named by ``node_config["sky-node"]`` or its partition id."""
    cfgn = context.node_config
    name = str(cfgn.get("sky-node", f"node{cfgn.get('partition-id', 0)}"))
    return Emulation(name=name)


def fleet_emulation(fleet: list[Emulation]) -> Callable[[Context], Emulation]:
    """Map simulation partition ``i`` to fleet node ``i``."""

    def emulation_fn(context: Context) -> Emulation:
        pid = int(context.node_config.get("partition-id", 0))
        if not 0 <= pid < len(fleet):
            raise ValueError(f"partition-id {pid} has no fleet entry ({len(fleet)} nodes)")
        return fleet[pid]

    return emulation_fn


def owner_data_fn(
    fleet: list[Emulation],
    dataset: str | dict = "digits",
    test_fraction: float = 0.2,
    seed: int = 0,
) -> Callable[[Context], Split | None]:
    """This node's partition if it is a data owner (``pipeline.data.owner_split``)."""
    from sky_flower.pipeline.data import owner_split

    owners = [n.name for n in fleet if n.holds_data]
    cache: dict[str, Split] = {}

    def load(context: Context) -> Split | None:
        emu = fleet_emulation(fleet)(context)
        if not emu.holds_data:
            return None
        if emu.name not in cache:  # the same seeded split as the server's
            i, n = owners.index(emu.name), len(owners)
            cache[emu.name] = owner_split(dataset, i, n, seed, test_fraction)
        return cache[emu.name]

    return load

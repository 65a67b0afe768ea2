"""Flat model vectors on Flower records, and a node's position in its fleet: the helpers
shared by the Hermes and decentralized strategies (server side) and their ClientApps.

Both features train a model held as one flat float vector ``(d,)``
(:class:`sky_flower.gossip.training.FlatModel`); on the wire it is an ``ArrayRecord``
holding one float32 array.
"""

from __future__ import annotations

import numpy as np
from flwr.app import Array, ArrayRecord, Context, RecordDict


def vector_record(key: str, vec: np.ndarray) -> ArrayRecord:
    """A flat vector ``(d,)`` as an ArrayRecord holding one float32 array ``key``."""
    return ArrayRecord({key: Array(np.asarray(vec, dtype=np.float32))})


def vector_of(content: RecordDict, record: str, key: str = "x") -> np.ndarray:
    """The flat vector ``content[record][key]`` as float64 ``(d,)``.

    Raises
    ------
    KeyError
        If the record or the array is missing.
    """
    return content.array_records[record][key].numpy().astype(np.float64)


def node_position(context: Context) -> int:
    """This node's position in its fleet (row of the gossip matrix, Hermes' worker
    index): ``node_config["dec-position"]`` on a SuperNode, else the simulation's
    ``partition-id`` (0 when neither is set)."""
    cfg = context.node_config
    return int(cfg.get("dec-position", cfg.get("partition-id", 0)))

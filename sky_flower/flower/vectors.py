"""Flat model vectors on Flower records, and a node's position in its fleet (node side:
:func:`node_position`; server side: :func:`order_by_position`): the helpers shared by
the Hermes and decentralized strategies and their ClientApps.

Both features train a model held as one flat float vector ``(d,)``
(:class:`sky_flower.gossip.training.FlatModel`); on the wire it is an ``ArrayRecord``
holding one float32 array.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from flwr.app import Array, ArrayRecord, Context, Message, RecordDict

from sky_flower.flower.exchange import Exchange


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


def order_by_position(
    replies: Sequence[Message], num_nodes: int, exchange: Exchange
) -> list[Message]:
    """The hello replies of a fleet ordered by the ``position`` each reports in its
    ``metrics`` record (:func:`node_position` on the node side).

    Raises
    ------
    NodeError
        Of ``exchange.error_cls``, naming every replying node, if the positions are not
        exactly ``0 .. num_nodes - 1``.
    """
    by_pos = {int(r.content.metric_records["metrics"]["position"]): r for r in replies}  # type: ignore[arg-type]
    if len(replies) != num_nodes or sorted(by_pos) != list(range(num_nodes)):
        positions = sorted(int(r.content.metric_records["metrics"]["position"]) for r in replies)  # type: ignore[arg-type]
        raise exchange.fail(
            f"nodes reported positions {positions}, expected 0..{num_nodes - 1}",
            [r.metadata.src_node_id for r in replies],
        )
    return [by_pos[i] for i in range(num_nodes)]

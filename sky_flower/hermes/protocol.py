"""Hermes' messages, server side: the message types the workers serve
(:class:`sky_flower.hermes.client.HermesClient`), the fleet's hello and readiness
barrier, the benchmark round's request, and the check of a round reply. Everything goes
through one :class:`sky_flower.flower.exchange.Exchange`, whose ``error_cls`` is raised.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from flwr.app import ConfigRecord, Message, RecordDict

from sky_flower.flower.exchange import Exchange
from sky_flower.flower.vectors import order_by_position

HELLO, PROFILE, ROUND = "query.hermes_hello", "query.hermes_profile", "train.hermes_round"


def to_all(ids: Sequence[int], message_type: str, cfg: ConfigRecord | None = None) -> list[Message]:
    """One ``message_type`` message to each node of ``ids`` (in order), carrying ``cfg``."""
    content = RecordDict() if cfg is None else RecordDict({"cfg": cfg})
    return [Message(content, dst_node_id=nid, message_type=message_type) for nid in ids]


def hello(
    exchange: Exchange, node_ids: Sequence[int], pool_size: int
) -> tuple[list[int], list[float]]:
    """Ask every node its position, pool size and emulated slowdown; return the node ids
    and slowdowns by position.

    Raises
    ------
    NodeError
        Of ``exchange.error_cls``: a node failed, reported another pool than
        ``pool_size``, or positions that are not exactly ``0 .. len(node_ids) - 1``.
    """
    replies = exchange.request(to_all(node_ids, HELLO))
    replies = order_by_position(replies, len(node_ids), exchange)
    for reply in replies:
        pool = int(reply.content.metric_records["metrics"]["pool"])  # type: ignore[arg-type]
        if pool != pool_size:
            nid = reply.metadata.src_node_id
            raise exchange.fail(
                f"{exchange.name(nid)}: pool of {pool}, expected {pool_size}", [nid]
            )
    slowdowns = [float(r.content.metric_records["metrics"]["slowdown"]) for r in replies]  # type: ignore[arg-type]
    return [r.metadata.src_node_id for r in replies], slowdowns


def ready_barrier(
    exchange: Exchange, ids: Sequence[int], hold_s: float, limit_s: float
) -> tuple[float, bool]:
    """Ask every worker to warm up and hold for ``hold_s`` at once, until all answer
    within ``1.6 x hold_s`` (so all ran in one wave, in parallel, already warm), for at
    most ``limit_s``. Returns the seconds spent and whether the wave came. Each wave's
    deadline is at least ``2 x hold_s``, whatever the exchange's message timeout.

    Raises
    ------
    NodeError
        Of ``exchange.error_cls``, as :meth:`Exchange.request`.
    """
    t0 = time.monotonic()
    wave_s = float("inf")
    timeout_s = max(exchange.timeout_s, 2.0 * hold_s)  # a hold is not a silence
    while wave_s >= 1.6 * hold_s and time.monotonic() - t0 < limit_s:
        t = time.monotonic()
        exchange.request(to_all(ids, HELLO, ConfigRecord({"hold_s": hold_s})), timeout_s)
        wave_s = time.monotonic() - t
    return time.monotonic() - t0, wave_s < 1.6 * hold_s


def profile(
    exchange: Exchange, ids: Sequence[int], batches: Sequence[int], repeats: int
) -> list[tuple[list[float], list[float]]]:
    """The benchmark round: every worker times ``repeats`` steps at each of ``batches``;
    per worker (by position), the batch sizes and the median seconds per step.

    Raises
    ------
    NodeError
        Of ``exchange.error_cls``, as :meth:`Exchange.request`.
    """
    cfg = ConfigRecord({"batches": list(batches), "repeats": int(repeats)})
    measured = []
    for reply in exchange.request(to_all(ids, PROFILE, cfg)):
        m = reply.content.metric_records["metrics"]
        measured.append((list(m["batches"]), list(m["seconds"])))  # type: ignore[arg-type]
    return measured


def round_reply_problem(reply: Message, dim: int) -> str | None:
    """Why a (non-error) ``train.hermes_round`` reply is malformed, or ``None``: it needs
    ``metrics`` with ``sent`` and ``train_time_s``; a sent round carries ``model["x"]``
    of shape ``(dim,)``, a minor round no arrays."""
    m = reply.content.metric_records.get("metrics")
    if m is None or "sent" not in m or "train_time_s" not in m:
        return "malformed round reply (no metrics)"
    rec = reply.content.array_records.get("model")
    if int(m["sent"]):  # type: ignore[arg-type]
        if rec is None or "x" not in rec or rec["x"].shape != (dim,):
            return "malformed model in its round reply"
    elif rec is not None:
        return "a minor round must carry no weights"
    return None

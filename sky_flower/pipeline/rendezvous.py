"""Rendezvous of a ``direct`` round: who may join its process group, and joining it.

The server hosts a ``torch.distributed`` TCPStore for the round (:class:`RoundHost`)
and writes one random ticket per rank under the round's fresh prefix key; each stage's
message carries only its own :class:`Rendezvous`. A stage that presents another ticket
is refused (:class:`RankRefusedError`) before it joins the group; :func:`join` waits,
bounded by the join timeout, until every planned stage has checked in, then builds the
gloo group (NCCL when every stage is on its own GPU) whose timeout bounds every later
peer operation.
"""

from __future__ import annotations

import datetime
import secrets
from dataclasses import dataclass

import torch
import torch.distributed as dist

TICKETS = "sky.tickets"
PEER_FAILURE = "stopped: a peer stage failed or stalled"
# gloo's errors when a peer is gone or silent (torch 2.13)
_PEER_SIGNS = ("Timed out", "Connection closed by peer", "Connection reset", "Broken pipe")


class DirectStageError(RuntimeError):
    """A stage of a ``direct`` round failed (the message names the stage and why)."""


class RankRefusedError(DirectStageError):
    """A node asked to join a round's process group with a rank it was not planned for."""


@dataclass(frozen=True)
class Rendezvous:
    """Where and as whom a stage joins one round's process group.

    Attributes
    ----------
    host : str
        TCPStore host (the server's address, reachable from every stage node).
    port : int
        TCPStore port.
    key : str
        Fresh random prefix for this round's keys (only the planned stages get it).
    rank : int
        This stage's rank = its stage index, ``0 <= rank < world_size``.
    world_size : int
        Number of stages ``S``.
    ticket : str
        This rank's ticket, checked against the store before joining.
    timeout_s : float
        Bound (seconds) on every peer operation of the round (a stage that fails or
        stalls mid-round ends the round for all within about this time).
    join_timeout_s : float (default: 60.0)
        Bound (seconds) on joining: reaching the store and waiting for every stage to
        join. At least ``timeout_s``; larger, since the stages' messages may start some
        seconds apart (a busy Flower simulation engine, a SuperNode's polling tick).
    backend : {"gloo", "nccl"} (default: "gloo")
        The group's backend: ``nccl`` only when every stage computes on its own GPU
        (:func:`sky_flower.pipeline.device.direct_backend`); with ``gloo`` a GPU stage's
        tensors cross to the CPU at its edges.
    """

    host: str
    port: int
    key: str
    rank: int
    world_size: int
    ticket: str
    timeout_s: float
    join_timeout_s: float = 60.0
    backend: str = "gloo"

    def __post_init__(self) -> None:
        if self.backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be gloo or nccl, got {self.backend!r}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} outside a world of {self.world_size} stages")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")


class RoundHost:
    """Server side of a round's rendezvous: a TCPStore with one ticket per rank.

    Parameters
    ----------
    host : str (default: "127.0.0.1")
        Address to listen on; the stages connect to it.
    world_size : int
        Number of stages.
    timeout_s : float
        Bound on every peer operation of the round, seconds.
    join_timeout_s : float (default: 60.0)
        Bound on joining the round, seconds (see :class:`Rendezvous`).
    backend : {"gloo", "nccl"} (default: "gloo")
        The round's process-group backend (see :class:`Rendezvous`).

    Use as a context manager; the store stops when it exits.
    """

    def __init__(
        self,
        world_size: int,
        timeout_s: float,
        host: str = "127.0.0.1",
        join_timeout_s: float = 60.0,
        backend: str = "gloo",
    ) -> None:
        self.backend = backend
        self.host, self.world_size, self.timeout_s = host, world_size, timeout_s
        self.join_timeout_s = max(join_timeout_s, timeout_s)
        self.key = f"sky-{secrets.token_hex(8)}"
        self.tickets = [secrets.token_hex(8) for _ in range(world_size)]
        self.store = dist.TCPStore(
            host,
            0,
            is_master=True,
            wait_for_workers=False,
            timeout=datetime.timedelta(seconds=self.join_timeout_s),
        )
        self.port = int(self.store.port)
        prefixed = dist.PrefixStore(f"{self.key}/{TICKETS}", self.store)
        for rank, ticket in enumerate(self.tickets):
            prefixed.set(str(rank), ticket)

    def rendezvous(self, rank: int) -> Rendezvous:
        """The rendezvous of stage ``rank`` (goes into that stage's message only)."""
        return Rendezvous(
            self.host,
            self.port,
            self.key,
            rank,
            self.world_size,
            self.tickets[rank],
            self.timeout_s,
            self.join_timeout_s,
            self.backend,
        )

    def close(self) -> None:
        """Stop the store."""
        del self.store

    def __enter__(self) -> RoundHost:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _device(host: str):  # noqa: ANN202 - a ProcessGroupGloo.Device
    if host in ("127.0.0.1", "localhost"):
        return dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")
    return dist.ProcessGroupGloo.create_default_device()


def join(rdv: Rendezvous, device: torch.device | None = None) -> None:
    """Join the round's process group (``rdv.backend``: gloo, or NCCL bound to this
    stage's GPU ``device``) as ``rdv.rank`` (bounded by ``rdv.join_timeout_s``;
    afterwards its operations by ``rdv.timeout_s``).

    Raises
    ------
    RankRefusedError
        If the store holds another ticket for this rank (not the planned node).
    DirectStageError
        If the store or the other stages cannot be reached in time.
    """
    if dist.is_initialized():  # a previous round that did not clean up (should not happen)
        dist.destroy_process_group()
    join_s = max(rdv.join_timeout_s, rdv.timeout_s)
    timeout = datetime.timedelta(seconds=join_s)
    try:
        base = dist.TCPStore(
            rdv.host, rdv.port, is_master=False, wait_for_workers=False, timeout=timeout
        )
        store = dist.PrefixStore(rdv.key, base)
        expected = dist.PrefixStore(TICKETS, store).get(str(rdv.rank)).decode()
    except (RuntimeError, OSError) as err:
        raise DirectStageError(
            f"stage {rdv.rank}: cannot reach the round's store at {rdv.host}:{rdv.port} "
            f"within {join_s:g} s: {err}"
        ) from err
    if not secrets.compare_digest(expected, rdv.ticket):
        raise RankRefusedError(
            f"rank {rdv.rank} refused: this node's ticket does not match the one planned for "
            "that rank (only the round's planned nodes may join)"
        )
    # Wait (up to the join timeout) until every planned stage has checked in; only then
    # build the group, whose timeout (gloo fixes it when it connects) is the shorter
    # round timeout that bounds every operation.
    op_timeout = datetime.timedelta(seconds=rdv.timeout_s)
    extra: dict = {}
    if rdv.backend == "nccl":  # every stage on its own GPU (direct_backend)
        if device is None or device.type != "cuda":
            raise DirectStageError(
                f"stage {rdv.rank}: the round uses NCCL (every stage planned on a GPU), "
                f"but this stage computes on {device or 'the CPU'}"
            )
        extra["device_id"] = device
    else:
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = op_timeout
        opts._devices = [_device(rdv.host)]
        extra["pg_options"] = opts
    try:
        arrived = dist.PrefixStore("arrived", store)
        arrived.set(str(rdv.rank), "1")
        arrived.wait([str(r) for r in range(rdv.world_size)], timeout)
        dist.init_process_group(
            rdv.backend,
            store=dist.PrefixStore("pg", store),
            rank=rdv.rank,
            world_size=rdv.world_size,
            timeout=op_timeout,
            **extra,
        )
    except (RuntimeError, OSError) as err:
        raise DirectStageError(
            f"stage {rdv.rank} of {rdv.world_size}: {PEER_FAILURE} (the other stages did not "
            f"all join within {join_s:g} s): {_first_line(err)}"
        ) from err


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[0][:300] if text else ""

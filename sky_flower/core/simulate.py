"""Discrete-event simulation of one pipelined training step (pure: numpy only).

The cost model (:mod:`sky_flower.core.cost`) predicts a step from closed forms; this module
plays the executed schedule op by op and is the reference those closed forms are checked
against.

Model
-----
A step pushes ``M`` identical micro-batches through ``S`` stages. The resources are

* ``"stage{k}"`` for each stage ``k``: runs one op at a time, the forward ``F`` and
  backward ``B`` of each micro-batch, in the schedule's fixed per-stage order (below);
* ``"link{k}>{k+1}"``: carries activations forward (op kind ``SF``), one micro-batch at a
  time, first in first out in the order they become ready (ties by micro-batch);
* ``"link{k+1}>{k}"``: carries gradients back (op kind ``SB``), likewise. The two
  directions of a link are separate resources (full duplex).

Compute and communication overlap: a stage starts its next op while its sends are in
flight, as with the asynchronous ``isend``/``irecv`` of ``torch.distributed.pipelining``.
An op starts at the later of "its resource is free" and "its inputs have arrived":

* ``F(m)`` on stage ``k > 0`` needs ``SF(m)`` on link ``k-1>k`` finished;
* ``SF(m)`` on link ``k>k+1`` needs ``F(m)`` on stage ``k``; ``SB(m)`` on link ``k+1>k``
  needs ``B(m)`` on stage ``k+1``;
* ``B(m)`` on stage ``k`` needs ``F(m)`` on stage ``k`` and, for ``k < S-1``, ``SB(m)``
  on link ``k+1>k``; the last stage computes the loss inside its ``F``, so its ``B(m)``
  follows its own ``F(m)``.

Every schedule below runs each stage's forwards, and each stage's backwards, in
micro-batch order, so transfers become ready on every link in micro-batch order and FIFO
service is service in micro-batch order. With all orders fixed the step is a longest path
through a DAG; :func:`simulate` walks it with a work list in ``O(S M)`` op visits
(:func:`sky_flower.core.virtual.play`, which plays the chunked schedules too: this is its
case of one chunk per stage).

Schedules (``kind``), as per-stage op orders:

* ``"sequential"``: ``F0 B0 F1 B1 ...`` on every stage, so micro-batch ``m + 1`` enters
  stage 0 only once ``m`` has come all the way back: no overlap at all. This is
  SkyComputing's execution and the relay transport's (``M = 1``: one batch).
* ``"gpipe"`` (Huang et al. 2019, arXiv 1811.06965; ``ScheduleGPipe`` in
  ``torch.distributed.pipelining``): ``F0 .. F(M-1)`` then ``B0 .. B(M-1)`` on every
  stage; every stage stashes the activations of all ``M`` micro-batches.
* ``"1f1b"`` (PipeDream-Flush, Narayanan et al. 2021, arXiv 2006.09503; torch's
  ``Schedule1F1B``): stage ``k`` runs ``W = min(S - k - 1, M)`` warm-up forwards
  ``F0 .. F(W-1)``, then ``F(W+i) B(i)`` for ``i`` in ``range(M - W)``, then the
  cool-down ``B(M-W) .. B(M-1)``; at most ``min(S - k, M)`` micro-batches are in flight
  on stage ``k``. torch counts the warm-up as ``min(M, S - k)`` forwards (one more) and
  then loops "one B, one F" instead of "one F, one B": the per-stage op sequence is
  identical, and that sequence is what this module follows. (torch's own schedule IR,
  ``Schedule1F1B._get_pipeline_order``, counts ``S - k - 1`` warm-ups as here. torch 2.13
  requires ``M >= S`` for ``Schedule1F1B``; here any ``M >= 1`` is accepted.)

Where torch differs from the model: in its 1F1B loop a stage waits for its forward send
to complete together with the next gradient receive, and before each later send for the
previous one, so a link slower than the stages stalls the sender a little more than here.
The model charges each link direction as its own FIFO server and lets compute run on.

Closed form. The ``"gpipe"`` order's step time is exact, not an approximation:
``(sum Fr + (M-1) max Fr) + (sum Br + (M-1) max Br)``, ``Fr`` the forward resources'
per-micro-batch times (every stage's forward and every forward link), ``Br`` the
backward ones. The forward phase is a flow shop of identical jobs over the resources
``stage0, link0>1, stage1, ..., stage(S-1)``, whose makespan is ``sum + (M-1) max`` of
the per-job times; the last stage's ``B0`` starts the moment its ``F(M-1)`` ends (the
loss is local, the stage is free); every other stage has finished its forwards before the
first gradient can reach it, and the backward links are resources of their own, so the
backward phase is again a clean flow shop with every job released at that moment. The
cost model's ``gpipe`` step time (:meth:`sky_flower.core.cost.CostModel.step_time_of`)
is this formula; the tests check it against :func:`simulate`.

Units: seconds throughout (per micro-batch for the inputs, absolute from the start of the
step for op times).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from sky_flower.core.virtual import Action, peak_stash, play

KINDS: tuple[str, ...] = ("sequential", "gpipe", "1f1b")


@dataclass(frozen=True)
class Op:
    """One event of the simulated timeline.

    Attributes
    ----------
    resource : str
        ``"stage{k}"``, ``"link{k}>{k+1}"`` (activations forward) or ``"link{k+1}>{k}"``
        (gradients back).
    kind : str
        ``"F"`` forward, ``"B"`` backward, ``"SF"`` send activations, ``"SB"`` send
        gradients.
    microbatch : int
        Index of the micro-batch, ``0 .. M-1``.
    start_s, end_s : float
        Seconds from the start of the step.
    """

    resource: str
    kind: str
    microbatch: int
    start_s: float
    end_s: float


@dataclass(frozen=True)
class SimResult:
    """Outcome of :func:`simulate`.

    Attributes
    ----------
    step_time_s : float
        End of the last op (seconds): the step's makespan.
    busy_s : dict[str, float]
        Seconds each resource spends working, keyed by resource name; every stage and
        both directions of every link appear, idle ones with ``0.0``.
    peak_inflight : list[int]
        Length ``S``: per stage, the most micro-batches whose activations are stashed at
        once (``F`` done, ``B`` not yet), i.e. the activation memory the schedule needs
        in units of one micro-batch's activations.
    ops : list[Op]
        Every op (``S M`` computes of each kind, ``(S-1) M`` transfers of each kind),
        sorted by start time.
    """

    step_time_s: float
    busy_s: dict[str, float]
    peak_inflight: list[int]
    ops: list[Op]


def _times(name: str, values: Sequence[float] | np.ndarray, length: int) -> list[float]:
    arr = np.asarray(values, dtype=float)
    if arr.ndim != 1 or arr.shape[0] != length:
        raise ValueError(f"{name} must be a 1-D sequence of length {length}, got shape {arr.shape}")
    bad = ~np.isfinite(arr) | (arr < 0)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise ValueError(f"{name}[{i}] = {float(arr[i])!r}: times must be finite and >= 0 seconds")
    return [float(x) for x in arr]


def stage_order(
    kind: str, stages: int, microbatches: int, interleave_last: bool = False
) -> list[list[Action]]:
    """Per-stage op order of a schedule.

    Parameters
    ----------
    kind : {"sequential", "gpipe", "1f1b"}
        Schedule (see the module docstring).
    stages : int
        Number of stages ``S >= 1``.
    microbatches : int
        Number of micro-batches ``M >= 1``.
    interleave_last : bool, default False
        The last stage runs ``F0 B0 F1 B1 ...`` whatever the kind (the relay transport,
        where one Flower message does the last stage's forward, loss and backward).

    Returns
    -------
    list[list[Action]]
        Length ``S``; entry ``k`` lists stage ``k``'s ops in execution order as
        :class:`sky_flower.core.virtual.Action` ``(op, k, microbatch)``, ``op`` ``F``
        or ``B``, ``2 M`` of them.

    Raises
    ------
    ValueError
        Unknown ``kind``, or ``stages`` / ``microbatches`` below 1.
    """
    if kind not in KINDS:
        raise ValueError(f"unknown schedule kind {kind!r}; valid kinds: {', '.join(KINDS)}")
    if stages < 1 or microbatches < 1:
        raise ValueError(f"need stages >= 1 and microbatches >= 1, got {stages}, {microbatches}")
    m_all = range(microbatches)
    orders = []
    for k in range(stages):
        if kind == "sequential":
            order = [(c, m) for m in m_all for c in ("F", "B")]
        elif kind == "gpipe":
            order = [("F", m) for m in m_all] + [("B", m) for m in m_all]
        else:
            w = min(stages - k - 1, microbatches)
            order = [("F", m) for m in range(w)]
            for i in range(microbatches - w):
                order += [("F", w + i), ("B", i)]
            order += [("B", m) for m in range(microbatches - w, microbatches)]
        if interleave_last and k == stages - 1:
            order = [(c, m) for m in m_all for c in ("F", "B")]
        orders.append([Action(c, k, m) for c, m in order])
    return orders


def simulate(
    fwd_s: Sequence[float] | np.ndarray,
    bwd_s: Sequence[float] | np.ndarray,
    fwd_link_s: Sequence[float] | np.ndarray,
    bwd_link_s: Sequence[float] | np.ndarray,
    microbatches: int,
    kind: str = "gpipe",
    interleave_last: bool = False,
) -> SimResult:
    """Play one training step of a pipeline schedule, op by op.

    Parameters
    ----------
    fwd_s, bwd_s : sequence of float, shape (S,)
        Seconds per micro-batch of each stage's forward and backward (``S >= 1``).
    fwd_link_s, bwd_link_s : sequence of float, shape (S-1,)
        Seconds to move one micro-batch's activations from stage ``k`` to ``k+1``, and its
        gradients from ``k+1`` back to ``k``.
    microbatches : int
        Micro-batches per step, ``M >= 1``.
    kind : {"sequential", "gpipe", "1f1b"}, default "gpipe"
        Schedule; see the module docstring for each one's per-stage order and source.
    interleave_last : bool, default False
        As :func:`stage_order`.

    Returns
    -------
    SimResult
        Step time (seconds), per-resource busy seconds, per-stage peak micro-batches in
        flight, and the full op timeline.

    Raises
    ------
    ValueError
        Wrong lengths, a negative or non-finite time, ``microbatches < 1`` or not an int,
        or an unknown ``kind``.

    Examples
    --------
    >>> simulate([1.0, 1.0], [2.0, 2.0], [0.0], [0.0], microbatches=4).step_time_s
    15.0
    """
    shape = np.asarray(fwd_s, dtype=float).shape
    if len(shape) != 1 or shape[0] < 1:
        raise ValueError(
            f"fwd_s must be a non-empty 1-D sequence (one entry per stage), got shape {shape}"
        )
    s, mb = shape[0], microbatches
    f, b = _times("fwd_s", fwd_s, s), _times("bwd_s", bwd_s, s)
    fl, bl = _times("fwd_link_s", fwd_link_s, s - 1), _times("bwd_link_s", bwd_link_s, s - 1)
    if isinstance(mb, bool) or not isinstance(mb, int | np.integer):
        raise ValueError(f"microbatches must be an int >= 1, got {mb!r}")
    if mb < 1:
        raise ValueError(f"microbatches must be >= 1, got {mb}")
    orders = stage_order(kind, s, mb, interleave_last)
    rec, names, step = play(orders, f, b, fl, bl, int(mb))  # ties in time: stages, then links
    busy = {n: 0.0 for n in names[:s]}
    for k in range(s - 1):  # every link, both directions, idle or not
        busy[names[s + k]] = busy[names[2 * s - 1 + k]] = 0.0
    ops = []
    for start, end, res, op, _, m in rec:
        busy[names[res]] += end - start
        ops.append(Op(names[res], op, m, start, end))
    peak = [int(p) for p in peak_stash(orders, [1.0] * s)]
    return SimResult(step_time_s=step, busy_s=busy, peak_inflight=peak, ops=ops)

"""Decentralized training as Flower strategies: D-PSGD, D2, DSGT, DeTAG.

Flower has no peer-to-peer channel, so the server plays the network: it holds every
node's model (and tracker) as a row of the ``(n, d)`` stack of the gossip core
(:mod:`sky_flower.gossip.algorithms`) and applies the gossip matrix; each node (a
SuperNode running :class:`sky_flower.gossip.client.DecentralizedClient`) computes
stochastic gradients on its own data. One *step* of an algorithm is one Flower message per node
(``train.dec_grad``) and costs ``rounds_per_step`` gossip rounds (DeTAG: a phase of
``R``; the others: 1). ``num_rounds`` in :meth:`DecentralizedStrategy.start` counts
gossip (communication) rounds, so the algorithms are compared at equal communication.

Usage (ServerApp side)::

    gossip = gossip_matrix("ring", 8)
    strategy = DeTAGStrategy(gossip=gossip, lr=0.05, batch_size=16)
    strategy.start(grid=grid, initial_arrays=vector_record("x", x0), num_rounds=100,
                   evaluate_fn=central_evaluate)
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from logging import INFO
from typing import Any, ClassVar

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy
from flwr.serverapp.strategy.strategy_utils import sample_nodes
from flwr.supercore import log

from sky_flower.flower.exchange import Exchange, NodeError
from sky_flower.flower.finite import NonFiniteError, check_finite
from sky_flower.flower.vectors import order_by_position, vector_record
from sky_flower.gossip import protocol
from sky_flower.gossip.algorithms import DecentralizedAlgorithm, make_algorithm
from sky_flower.gossip.matrices import GossipMatrix


class DecentralizedNodeError(NodeError):
    """A node failed, timed out, or replied with something malformed; ``node_ids`` and
    ``nodes`` name it (``nodes``: ``"position <i>"``)."""


class DecentralizedStrategy(Strategy):
    """Base of the decentralized strategies; subclasses pick the update rule.

    Parameters
    ----------
    gossip : GossipMatrix
        The network: ``n`` nodes and their ``(n, n)`` gossip matrix. Node ``i`` of the
        matrix is the SuperNode whose ``query.dec_hello`` reports position ``i``.
    lr : float (default: 0.05)
        Step size ``alpha`` (> 0).
    batch_size : int (default: 16)
        Examples per mini-batch on each node.
    phase_rounds : int (default: 0)
        DeTAG only: gossip rounds per phase ``R`` (0: by ``phase_rule``).
    seed : int (default: 0)
        Seeds the nodes' mini-batch draws.
    message_timeout_s : float (default: 120.0)
        A node silent for longer fails the run, by position (so does a node whose
        gradient or loss is not finite: gossip needs every node at every step).
    poll_interval_s : float (default: 0.002)
        Pause (s) between two polls for replies (:class:`sky_flower.flower.exchange.Exchange`);
        raise it against a real SuperLink, where every poll is an RPC.
    on_event : Callable[[str, dict], None], optional
        Called with ``("round", row)`` after each step.
    variant, phase_rule : str (default: "paper", "sqrt")
        DeTAG only: :class:`sky_flower.gossip.algorithms.DeTAG`'s update variant
        (``paper``, the paper's Algorithm 2, or ``atc``) and automatic phase rule
        (``sqrt`` or ``log``).

    Raises
    ------
    ValueError
        On a bad setting (``lr``, ``batch_size``, ``poll_interval_s``, D2's
        ``lambda_min``), at construction, before any node is contacted.
    """

    algorithm_name: ClassVar[str] = ""

    def __init__(  # noqa: PLR0913
        self,
        gossip: GossipMatrix,
        lr: float = 0.05,
        batch_size: int = 16,
        phase_rounds: int = 0,
        seed: int = 0,
        message_timeout_s: float = 120.0,
        on_event: Callable[[str, dict], None] | None = None,
        poll_interval_s: float = 0.002,
        variant: str = "paper",
        phase_rule: str = "sqrt",
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if not message_timeout_s > 0 or not poll_interval_s >= 0:
            raise ValueError(
                f"message_timeout_s must be > 0 (got {message_timeout_s}) and "
                f"poll_interval_s >= 0 (got {poll_interval_s})"
            )
        self.gossip = gossip
        self.algorithm: DecentralizedAlgorithm = make_algorithm(
            self.algorithm_name, gossip, lr, phase_rounds, variant, phase_rule
        )
        self.batch_size, self.seed = int(batch_size), int(seed)
        self.message_timeout_s = float(message_timeout_s)
        self.poll_interval_s = float(poll_interval_s)
        self.on_event = on_event or (lambda kind, payload: None)
        self.rounds: list[dict[str, Any]] = []
        self._ids: list[int] = []  # node id of each gossip-matrix position
        self._exchange: Exchange | None = None

    # --- messaging -------------------------------------------------------------------
    def _describe(self, node_id: int) -> str | None:
        return f"position {self._ids.index(node_id)}" if node_id in self._ids else None

    def _request(self, messages: list[Message]) -> list[Message]:
        """Push ``messages``; return the replies in message order.

        Raises
        ------
        DecentralizedNodeError
            Naming the node(s) that timed out or replied with an error.
        """
        assert self._exchange is not None, "connect() first"
        return self._exchange.request(messages)

    def connect(self, grid: Grid) -> list[int]:
        """Wait for ``n`` nodes, ask each its position; return node ids by position.

        Raises
        ------
        DecentralizedNodeError
            A node failed, or positions that are not exactly ``0..n-1``.
        """
        n = self.gossip.n
        node_ids, _ = sample_nodes(grid, n, n)
        self._exchange = Exchange(
            grid,
            self.message_timeout_s,
            self.poll_interval_s,
            describe=self._describe,
            error_cls=DecentralizedNodeError,
        )
        hello = [
            Message(RecordDict(), dst_node_id=nid, message_type=protocol.HELLO) for nid in node_ids
        ]
        replies = order_by_position(self._request(hello), n, self._exchange)
        self._ids = [r.metadata.src_node_id for r in replies]
        return self._ids

    # --- Strategy interface ----------------------------------------------------------
    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """One ``train.dec_grad`` per node: its own model row and the averaged model
        (``arrays``); ``config`` carries ``step``."""
        alg = self.algorithm
        cfg = ConfigRecord(
            {
                "step": int(config["step"]),
                "batches": alg.batches_per_step,
                "batch_size": self.batch_size,
                "seed": self.seed,
            }
        )
        xbar = vector_record("xbar", arrays["x"].numpy())
        return [
            Message(
                RecordDict({"x": vector_record("x", alg.x[i]), "xbar": xbar, "cfg": cfg}),
                dst_node_id=nid,
                message_type=protocol.GRAD,
                group_id=str(server_round),
            )
            for i, nid in enumerate(self._ids)
        ]

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Stack the gradients by position, take one step of the algorithm; return the new
        averaged model and ``{"node_loss", "avg_model_loss"}`` (the latter of the model the
        gradients were taken at)."""
        replies = list(replies)
        grads = np.zeros(self.algorithm.x.shape)
        losses, avg_losses = [], []
        for reply in replies:
            pos = self._ids.index(reply.metadata.src_node_id)
            rec = reply.content.array_records.get("grad")
            if rec is None or "grad" not in rec or rec["grad"].shape != (grads.shape[1],):
                nid = reply.metadata.src_node_id
                assert self._exchange is not None
                raise self._exchange.fail(f"{self._exchange.name(nid)}: malformed gradient", [nid])
            metrics = reply.content.metric_records["metrics"]
            self._check_finite(reply, rec, metrics)
            grads[pos] = rec["grad"].numpy()
            losses.append(float(metrics["loss"]))
            avg_losses.append(float(metrics["avg_model_loss"]))
        self.algorithm.step(grads)
        metrics = MetricRecord(
            {"node_loss": float(np.mean(losses)), "avg_model_loss": float(np.mean(avg_losses))}
        )
        return vector_record("x", self.algorithm.average), metrics

    def _check_finite(
        self, reply: Message, grad: ArrayRecord | None, metrics: MetricRecord
    ) -> None:
        """Refuse a node's non-finite gradient or loss by name. Gossip needs every node's
        gradient at every step (the trackers of DSGT / DeTAG hold their sum), so there is
        no step without it: the run stops, every model as it was before this step.

        Raises
        ------
        DecentralizedNodeError
            Naming the node (its position), the cause a
            :class:`sky_flower.flower.finite.NonFiniteError`.
        """
        ex, nid = self._exchange, reply.metadata.src_node_id
        assert ex is not None
        try:
            if grad is not None:
                check_finite(grad, f"{ex.name(nid)}'s gradient")
            check_finite(metrics, f"{ex.name(nid)}'s losses")
        except NonFiniteError as err:
            raise ex.fail(f"{err}: the run stops, the models as before this step", [nid]) from err

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """``query.dec_eval`` to every node: training loss of the averaged model."""
        xbar = vector_record("xbar", arrays["x"].numpy())
        return [
            Message(RecordDict({"xbar": xbar}), dst_node_id=nid, message_type=protocol.EVAL)
            for nid in self._ids
        ]

    def aggregate_evaluate(
        self, server_round: int, replies: Iterable[Message]
    ) -> MetricRecord | None:
        """Mean of the nodes' local losses of the averaged model (equal-size partitions)."""
        replies = list(replies)
        for reply in replies:
            self._check_finite(reply, None, reply.content.metric_records["metrics"])
        vals = [float(r.content.metric_records["metrics"]["avg_model_loss"]) for r in replies]
        return MetricRecord({"avg_model_loss": float(np.mean(vals))})

    def summary(self) -> None:
        """Log the network and the algorithm."""
        g, alg = self.gossip, self.algorithm
        log(INFO, "\t├── Algorithm: %s (lr %g, batch %d)", alg.name, alg.lr, self.batch_size)
        log(INFO, "\t├── Network: %s, %d nodes, spectral gap %.4g", g.topology, g.n, g.spectral_gap)
        log(INFO, "\t└── Gossip rounds per step: %d", alg.rounds_per_step)

    # --- the run ---------------------------------------------------------------------
    def start(  # noqa: PLR0913
        self,
        grid: Grid,
        initial_arrays: ArrayRecord,
        num_rounds: int = 100,
        timeout: float = 3600,
        train_config: ConfigRecord | None = None,
        evaluate_config: ConfigRecord | None = None,
        evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None,
    ) -> Result:
        """Run ``num_rounds`` gossip rounds (``num_rounds // rounds_per_step`` steps).

        ``initial_arrays`` holds ``"x"``: the initial flat model ``(d,)``, the same on
        every node. ``evaluate_fn(round, vector_record("x", xbar))`` evaluates the averaged
        model (e.g. test accuracy). ``self.rounds`` gets one row per step and one for the
        start: ``round`` (gossip rounds so far), ``loss`` (training loss of the averaged
        model over all nodes' data), ``node_loss`` (mean mini-batch loss of the step that
        led there), ``consensus_distance``, and ``test_*`` from ``evaluate_fn``.

        Raises
        ------
        ValueError
            ``num_rounds`` shorter than one step.
        DecentralizedNodeError
            A node failed; ``self.rounds`` keeps the rows done.
        """
        alg = self.algorithm
        steps = num_rounds // alg.rounds_per_step
        if steps < 1:
            raise ValueError(
                f"num_rounds={num_rounds} is shorter than one {alg.name} step of "
                f"{alg.rounds_per_step} gossip rounds"
            )
        log(INFO, "Starting %s strategy:", self.__class__.__name__)
        self.summary()
        t_start = time.time()
        self.connect(grid)
        alg.reset(initial_arrays["x"].numpy())
        result = Result(arrays=initial_arrays)
        self._record(result, 0, None, evaluate_fn)
        log(INFO, "%6s %10s %10s %10s %12s", "round", "loss", "node loss", "test acc", "consensus")
        for step in range(steps):
            xbar = vector_record("x", alg.average)
            msgs = list(self.configure_train(step + 1, xbar, ConfigRecord({"step": step}), grid))
            arrays, metrics = self.aggregate_train(step + 1, self._request(msgs))
            assert arrays is not None and metrics is not None
            self._close_row(float(metrics["avg_model_loss"]))  # type: ignore[arg-type]
            result.arrays = arrays
            result.train_metrics_clientapp[step + 1] = metrics
            self._record(result, step + 1, float(metrics["node_loss"]), evaluate_fn)  # type: ignore[arg-type]
        msgs = list(self.configure_evaluate(steps, result.arrays, ConfigRecord(), grid))
        final = self.aggregate_evaluate(steps, self._request(msgs))
        assert final is not None
        self._close_row(float(final["avg_model_loss"]))  # type: ignore[arg-type]
        log(
            INFO,
            "%s finished %d gossip rounds in %.1f s",
            alg.name,
            steps * alg.rounds_per_step,
            time.time() - t_start,
        )
        return result

    def _record(
        self,
        result: Result,
        step: int,
        node_loss: float | None,
        evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None,
    ) -> None:
        """Open the row of ``step`` (its ``loss`` comes with the next replies)."""
        alg = self.algorithm
        row: dict[str, Any] = {
            "round": step * alg.rounds_per_step,
            "loss": None,
            "node_loss": node_loss,
            "consensus_distance": alg.consensus_distance(),
        }
        xbar = vector_record("x", alg.average)
        if evaluate_fn is not None and (res := evaluate_fn(step, xbar)) is not None:
            result.evaluate_metrics_serverapp[step] = res
            row.update({f"test_{k}": float(v) for k, v in res.items()})  # type: ignore[arg-type]
        self.rounds.append(row)

    def _close_row(self, loss: float) -> None:
        """Fill in the last row's ``loss`` (of the averaged model, from the nodes' own
        data), log it and report it."""
        self.rounds[-1]["loss"] = loss
        self._log(self.rounds[-1])
        self.on_event("round", self.rounds[-1])

    @staticmethod
    def _log(row: dict[str, Any]) -> None:
        acc = row.get("test_accuracy")
        log(
            INFO,
            "%6d %10.4f %10s %10s %12.3e",
            row["round"],
            row["loss"],
            "-" if row["node_loss"] is None else f"{row['node_loss']:.4f}",
            "-" if acc is None else f"{acc:.4f}",
            row["consensus_distance"],
        )


class DPSGDStrategy(DecentralizedStrategy):
    """D-PSGD (Lian et al., "Can Decentralized Algorithms Outperform Centralized
    Algorithms?", NeurIPS 2017, Algorithm 1): ``x_i <- sum_j W_ij x_j - alpha g_i(x_i)``.
    One gossip round per step. See :class:`DecentralizedStrategy` for the parameters."""

    algorithm_name = "dpsgd"


class D2Strategy(DecentralizedStrategy):
    """D2 (Tang et al., "D^2: Decentralized Training over Decentralized Data", ICML 2018,
    Algorithm 1): ``X_{t+1} = W (2 X_t - X_{t-1} - alpha G_t + alpha G_{t-1})``.

    Raises ``ValueError`` at construction if ``lambda_min(W) <= -1/3`` (e.g. the
    Metropolis-Hastings ring of an even number of nodes)."""

    algorithm_name = "d2"


class DSGTStrategy(DecentralizedStrategy):
    """DSGT (Pu and Nedic, "Distributed stochastic gradient tracking methods", Math.
    Programming 2021): ``y_t = W y_{t-1} + g_t - g_{t-1}``, ``x_{t+1} = W (x_t - alpha
    y_t)``. The server keeps the trackers ``y_i`` beside the models."""

    algorithm_name = "dsgt"


class DeTAGStrategy(DecentralizedStrategy):
    """DeTAG (Lu and De Sa, "Optimal Complexity in Decentralized Training", ICML 2021,
    Algorithm 2): gradient tracking, accelerated gossip over a phase of ``R`` rounds
    (``eta = (1 - sqrt(1 - l^2)) / (1 + sqrt(1 - l^2))``), the gradient accumulated over
    ``R`` mini-batches per phase (each node gets one message per phase, asking for ``R``
    mini-batches). See :class:`sky_flower.gossip.algorithms.DeTAG`."""

    algorithm_name = "detag"


STRATEGIES: dict[str, type[DecentralizedStrategy]] = {
    cls.algorithm_name: cls for cls in (DPSGDStrategy, D2Strategy, DSGTStrategy, DeTAGStrategy)
}

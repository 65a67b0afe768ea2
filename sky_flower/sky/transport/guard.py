"""Finite or rejected, on the Sky protocol's server side.

Every reply is checked where it arrives at the server
(:mod:`sky_flower.flower.finite`): on the relay each stage's forward / backward reply
(activations, labels, input gradients, the last stage's loss and metrics:
:func:`check_reply`) and every stage's weights at the end of a round; on the direct
transport every stage's weights and metrics (:func:`check_stages`). A non-finite reply
fails its pipeline by name through the failed-round path
(:mod:`sky_flower.sky.rounds.federation`, :mod:`sky_flower.sky.rounds.recovery`).

Who is named: the stage whose output first goes non-finite. On the relay every input a
stage gets was checked finite when it arrived, so the first non-finite reply comes from
the stage that computed it (``SkyNodeError.nodes``: its node). Replies that arrive
together (the relay's weights at the end of a round, every reply of a direct round,
whose activations travel peer to peer and are never seen here) name their stage's node
only when it is the only non-finite one; when several are, every one is named and none
is blamed (divergence spreads through the whole pipeline in one step). Either way the
error is a :class:`NonFiniteReply` carrying the non-finite ``stages``: values computed
from finite inputs are not by themselves a node's fault, and
:func:`sky_flower.sky.rounds.blame.judge` decides whether the training diverged (no node is
dropped) or one helper is suspect (set aside for one round).

:class:`RoundGuard` checks the round as a whole: a FedAvg aggregate that is non-finite,
or a training loss above ``divergence_factor`` times the best loss so far (optional, off
by default), fails the round; the global model stays the last finite one.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from flwr.app import ArrayRecord, Message

from sky_flower.flower.exchange import Exchange
from sky_flower.flower.finite import NonFiniteError, nonfinite_names
from sky_flower.sky.transport.runner import Pipeline, SkyNodeError


class NonFiniteReply(SkyNodeError):
    """A well-formed reply holding ``NaN``/``inf`` (see the module docstring).

    Attributes
    ----------
    stages : tuple[int, ...]
        The pipeline's stages whose replies held non-finite values (stage 0: the data
        owner's own stage).
    """

    def __init__(
        self,
        message: str,
        nodes: Sequence[str] | None = None,
        node_ids: Sequence[int] | None = None,
        stages: Sequence[int] = (),
    ) -> None:
        super().__init__(message, nodes=nodes, node_ids=node_ids)
        self.stages = tuple(stages)


def _nonfinite(ex: Exchange, text: str, causes: list[int], stages: list[int]) -> NonFiniteReply:
    base = ex.fail(text, causes)
    return NonFiniteReply(str(base), base.nodes, base.node_ids, stages)


def reply_nonfinite(reply: Message) -> list[str]:
    """Names of the non-finite arrays and metrics of ``reply`` (every array and metric
    record of its content; integer arrays are always finite)."""
    content = reply.content
    bad = [n for rec in content.array_records.values() for n in nonfinite_names(rec)]
    return bad + [n for rec in content.metric_records.values() for n in nonfinite_names(rec)]


def _text(ex: Exchange, plan: Pipeline, k: int, reply: Message, names: list[str]) -> str:
    who = f"the reply of stage {k} on {ex.name(plan.node_ids[k])} to {reply.metadata.message_type}"
    return str(NonFiniteError(who, names))


def check_reply(ex: Exchange, plan: Pipeline, k: int, reply: Message) -> None:
    """Check stage ``k``'s reply as it arrives (relay forward / backward).

    Raises
    ------
    NonFiniteReply
        Naming the stage (``stages``: ``(k,)``), its node (``nodes``) and the non-finite
        arrays or metrics, e.g. ``the reply of stage 1 on node1 (node 102) to
        train.sky_forward holds non-finite values (NaN or inf) in act``.
    """
    bad = reply_nonfinite(reply)
    if bad:
        raise _nonfinite(ex, _text(ex, plan, k, reply, bad), [reply.metadata.src_node_id], [k])


def check_stages(ex: Exchange, plan: Pipeline, replies: Sequence[Message]) -> None:
    """Check every stage's reply of a round at once (``replies[k]``: stage ``k``'s; the
    relay's collected weights, a direct round's weights and metrics).

    Raises
    ------
    NonFiniteReply
        Naming every stage whose reply holds ``NaN``/``inf`` (``stages``) and what holds
        it; its node is named in ``nodes`` only when it is the only such stage, else
        ``nodes`` is empty (see the module docstring).
    """
    found = [(k, r, reply_nonfinite(r)) for k, r in enumerate(replies)]
    found = [(k, r, bad) for k, r, bad in found if bad]
    if not found:
        return
    text = "; ".join(_text(ex, plan, k, r, bad) for k, r, bad in found)
    causes = [plan.node_ids[found[0][0]]] if len(found) == 1 else []
    if len(found) > 1:
        text += " (several stages at once: no single node is blamed)"
    raise _nonfinite(ex, text, causes, [k for k, _, _ in found])


@dataclass
class RoundGuard:
    """The round-level checks of :func:`sky_flower.sky.rounds.federation.federated_round`.

    Attributes
    ----------
    divergence_factor : float
        ``0``: off (the default). Else ``>= 1``: a round whose training loss exceeds
        ``divergence_factor`` times the best (lowest) training loss of the rounds
        accepted so far fails, like a non-finite round (for non-negative losses).
    best_loss : float or None
        The best training loss so far (None before the first accepted round).
    """

    divergence_factor: float = 0.0
    best_loss: float | None = None

    def __post_init__(self) -> None:
        f = self.divergence_factor
        if not (f == 0 or (math.isfinite(f) and f >= 1)):
            raise ValueError(f"divergence_factor must be 0 (off) or >= 1 (got {f})")

    def check(self, server_round: int, train_loss: float | None, new: ArrayRecord) -> str:
        """Why round ``server_round`` (its training loss ``train_loss`` and the new
        global model ``new``) fails (:meth:`reason`), else ``""`` and the round counts
        as accepted (its loss may become the best). No node is blamed: the round's
        aggregate or its loss is at fault, not one reply, and the strategy reports a
        divergence (:mod:`sky_flower.sky.rounds.recovery`).
        """
        loss = float(train_loss if train_loss is not None else 0.0)
        text = self.reason(server_round, loss, new)
        if not text:
            self.best_loss = loss if self.best_loss is None else min(self.best_loss, loss)
        return text

    def reason(self, server_round: int, loss: float, new: ArrayRecord) -> str:
        """Why round ``server_round`` fails (``""``: it does not): a non-finite
        aggregate ``new`` (naming its arrays), a non-finite training ``loss``, or a loss
        above ``divergence_factor`` x :attr:`best_loss`."""
        bad = nonfinite_names(new)
        if bad:
            return str(NonFiniteError(f"round {server_round}'s FedAvg aggregate", bad))
        if not math.isfinite(loss):
            return f"round {server_round}'s training loss is {loss}"
        best, factor = self.best_loss, self.divergence_factor
        if factor and best is not None and loss > factor * best:
            return (
                f"round {server_round} diverged: training loss {loss:.6g} exceeds "
                f"divergence_factor={factor:g} x the best loss so far {best:.6g}"
            )
        return ""

"""Who is to blame for a failed round: a node, or the training itself.

A node is dropped only for a fault that is its own: it was silent past its deadline,
its reply was an error or malformed (missing records, wrong shapes), or it crashed
(:class:`~sky_flower.sky.transport.runner.SkyNodeError` naming it). Non-finite values in a
well-formed reply are different: every input a relay stage gets was checked finite
where it arrived (:mod:`sky_flower.sky.transport.guard`), so they were *computed* from finite
inputs and the stage's weights, and a learning rate that is too high (or a model that
produces ``NaN``) does exactly that, on whichever node holds the layers. Dropping that
node (the old rule) drops a healthy helper, then the next one, and never says why.

:func:`judge` decides from a failed round's pipelines (and what earlier rounds showed):

**diverged** (no node is dropped; the run says the training diverged, naming the
learning rate and the round) when the non-finite values originate in computation that
no single helper explains:

- the data owner's own stage 0 went non-finite (its output, loss or weights: computed
  on its own data, refused up front if non-finite, and its own weights);
- several stages of a pipeline went non-finite at once (divergence spreads through the
  whole pipeline in one step);
- every pipeline of the round went non-finite (two or more data owners);
- the run is already *diverging*: a helper was set aside after a non-finite round and
  the next round went non-finite again, on other nodes (the same computation fails
  wherever it runs), or a divergence was found and no round has trained since.

**suspect** otherwise: one helper's output went non-finite on finite inputs and nothing
else did. Its node is *set aside* for the next round (the model re-planned without it),
not dropped: if that round trains finite, the node's own fault is confirmed and it stays
out (``dropped_nodes``); if it goes non-finite again, the training diverged and the node
is put back.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Failure:
    """One failed pipeline of a round, as :func:`judge` reads it.

    Attributes
    ----------
    owner : str
        The pipeline's data owner (its stage 0).
    nodes : tuple[str, ...]
        The nodes the runner blamed (for a non-finite failure: the stage's node when it
        was the only non-finite stage, else none).
    nonfinite_stages : tuple[int, ...]
        The stages whose reply held ``NaN``/``inf`` (empty: another kind of failure).
    """

    owner: str
    nodes: tuple[str, ...] = ()
    nonfinite_stages: tuple[int, ...] = ()

    @property
    def nonfinite(self) -> bool:
        """Whether the pipeline failed on non-finite values."""
        return bool(self.nonfinite_stages)


@dataclass(frozen=True)
class Verdict:
    """What a failed round says about its nodes (see the module docstring).

    Attributes
    ----------
    diverged : str
        Why the training diverged (``""``: it did not).
    drop : tuple[str, ...]
        Nodes whose own fault failed the round (silence, error, malformed reply).
    set_aside : tuple[str, ...]
        Helpers whose output alone went non-finite: left out of the next round only.
    """

    diverged: str = ""
    drop: tuple[str, ...] = ()
    set_aside: tuple[str, ...] = field(default_factory=tuple)


def judge(
    failures: Sequence[Failure],
    pipelines: int,
    diverging: bool = False,
    set_aside: Sequence[str] = (),
) -> Verdict:
    """The verdict on a round whose pipelines ``failures`` failed.

    Parameters
    ----------
    failures : sequence of Failure
        The failed pipelines (at least one).
    pipelines : int
        Pipelines the round ran (``len(failures)`` of them failed).
    diverging : bool
        Whether an earlier round already showed divergence and none has trained since.
    set_aside : sequence of str
        Helpers set aside after the previous round (non-finite suspects).

    Returns
    -------
    Verdict
        ``diverged`` set when the non-finite failures are the training's (then nothing
        is set aside); ``drop`` the nodes of the other failures, always.
    """
    drop = tuple(dict.fromkeys(n for f in failures if not f.nonfinite for n in f.nodes))
    bad = [f for f in failures if f.nonfinite]
    if not bad:
        return Verdict(drop=drop)
    why: list[str] = []
    for f in bad:
        if 0 in f.nonfinite_stages:
            why.append(f"the data owner {f.owner}'s own stage 0 went non-finite")
        if len(f.nonfinite_stages) > 1:
            stages = ", ".join(map(str, f.nonfinite_stages))
            why.append(f"stages {stages} of {f.owner}'s pipeline went non-finite at once")
    if pipelines > 1 and len(bad) == pipelines:
        why.append(f"every pipeline ({', '.join(f.owner for f in bad)}) went non-finite")
    if set_aside:
        why.append(
            f"it went non-finite again after {', '.join(set_aside)} was set aside: the "
            "same computation fails on other nodes"
        )
    elif diverging:
        why.append("no round has trained since the training diverged")
    if why:
        return Verdict(diverged="; ".join(dict.fromkeys(why)), drop=drop)
    suspects = tuple(dict.fromkeys(n for f in bad for n in f.nodes))
    return Verdict(drop=drop, set_aside=suspects)


def diverged_text(server_round: int, why: str, lr: float, cause: str = "") -> str:
    """The message of a diverged round: the round, the evidence ``why``, the learning
    rate with a suggested lower one, and what the stages reported (``cause``)."""
    lower = f"{lr / 10:g}" if math.isfinite(lr) and lr > 0 else "a lower value"
    tail = f" ({cause})" if cause else ""
    return (
        f"the training diverged in round {server_round}: {why}{tail}. This is not a node's "
        f"fault and no node is dropped: lower the learning rate (train.lr, run config "
        f"'lr'; now {lr:g}), e.g. to {lower}, or check the model and loss for operations "
        f"that produce NaN or inf"
    )

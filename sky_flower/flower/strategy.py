"""What the Flower strategies of sky-flower share as ``Strategy`` classes."""

from __future__ import annotations

from collections.abc import Iterable

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid


class ServerSideEvaluation:
    """Mixin (before ``flwr.serverapp.strategy.Strategy`` in the bases) for a strategy
    whose global model is evaluated on the server only (``start(evaluate_fn=...)``):
    no evaluation messages go to the nodes."""

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """No node-side evaluation: an empty list of messages."""
        return []

    def aggregate_evaluate(
        self, server_round: int, replies: Iterable[Message]
    ) -> MetricRecord | None:
        """No node-side evaluation: ``None``."""
        return None

"""Third-party notices a sky-flower user cannot act on, silenced one by one:
each is matched by its message and category and its module or logger, so any other
warning, and these libraries' own warnings and errors, still show."""

from __future__ import annotations

import logging
import warnings

#: Third-party notices that say nothing a sky-flower user can act on, each matched by
#: message, category and module (or logger), so any other warning still shows.
RAY_ACCEL_TIP = r"Tip: In future versions of Ray, Ray will no longer override accelerator"
RUN_SIMULATION_DEPRECATED = "DEPRECATED FEATURE: The `run_simulation` function is deprecated"
#: what every ClientApp actor of Flower's simulation engine logs as WARNING when the
#: engine shuts it down at the end of a run (``flwr.simulation.ray_transport.ray_actor``)
ACTOR_TERMINATING = "Manually terminating "


class _DropMessage(logging.Filter):
    """A logging filter dropping the records whose message starts with ``prefix``."""

    def __init__(self, prefix: str) -> None:
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.prefix)


def _drop_flwr_records(prefix: str) -> None:
    """Drop the ``flwr`` logger's records whose message starts with ``prefix``, once per
    prefix (idempotent: a second call adds no second filter)."""
    flwr_logger = logging.getLogger("flwr")
    if not any(isinstance(f, _DropMessage) and f.prefix == prefix for f in flwr_logger.filters):
        flwr_logger.addFilter(_DropMessage(prefix))


def quiet_third_party() -> None:
    """Silence the third-party notices of a default run: Ray's
    ``FutureWarning`` about accelerator environment variables (this runs on CPUs), the
    ``alembic`` migration plugins' INFO lines (Flower's in-memory SuperLink state) and
    Flower's notice that ``run_simulation`` is deprecated (the job calls it for the
    user; ``flwr run`` is the deployment path, docs/). Warnings and errors of these
    libraries, and every other warning, still show. Idempotent."""
    warnings.filterwarnings(
        "ignore", message=RAY_ACCEL_TIP, category=FutureWarning, module=r"ray\._private\.worker"
    )
    logging.getLogger("alembic").setLevel(logging.WARNING)
    _drop_flwr_records(RUN_SIMULATION_DEPRECATED)


def quiet_actor_exit() -> None:
    """In a ClientApp actor of Flower's simulation engine: drop the WARNING the actor
    logs when the engine shuts it down at the run's end ("Manually terminating
    ClientAppActor", one per actor, forwarded by Ray to the console of every run).
    Called by Sky's node handlers (they run in the actor; the entry points'
    :func:`quiet_third_party` runs in the driver). Every other record of the ``flwr``
    logger still shows. Idempotent, cheap."""
    _drop_flwr_records(ACTOR_TERMINATING)

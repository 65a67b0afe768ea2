"""Third-party notices a sky-flower user cannot act on, silenced one by one (issue 28):
each is matched by its message and category and its module or logger, so any other
warning, and these libraries' own warnings and errors, still show."""

from __future__ import annotations

import logging
import warnings

#: Third-party notices that say nothing a sky-flower user can act on, each matched by
#: message, category and module (or logger), so any other warning still shows.
RAY_ACCEL_TIP = r"Tip: In future versions of Ray, Ray will no longer override accelerator"
RUN_SIMULATION_DEPRECATED = "DEPRECATED FEATURE: The `run_simulation` function is deprecated"


class _DropMessage(logging.Filter):
    """A logging filter dropping the records whose message starts with ``prefix``."""

    def __init__(self, prefix: str) -> None:
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.prefix)


def quiet_third_party() -> None:
    """Silence the third-party notices of a default run (issue 28): Ray's
    ``FutureWarning`` about accelerator environment variables (this runs on CPUs), the
    ``alembic`` migration plugins' INFO lines (Flower's in-memory SuperLink state) and
    Flower's notice that ``run_simulation`` is deprecated (the job calls it for the
    user; ``flwr run`` is the deployment path, docs/). Warnings and errors of these
    libraries, and every other warning, still show. Idempotent."""
    warnings.filterwarnings(
        "ignore", message=RAY_ACCEL_TIP, category=FutureWarning, module=r"ray\._private\.worker"
    )
    logging.getLogger("alembic").setLevel(logging.WARNING)
    flwr_logger = logging.getLogger("flwr")
    if not any(isinstance(f, _DropMessage) for f in flwr_logger.filters):
        flwr_logger.addFilter(_DropMessage(RUN_SIMULATION_DEPRECATED))

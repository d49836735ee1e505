"""Logging setup for entry points only (CLI, API server, worker). Library modules just getLogger(__name__)."""

from __future__ import annotations

import logging
import sys


def setup_logging(level: str = "INFO") -> None:
    logging.basicConfig(
        level=level.upper(),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s %(process)d: %(message)s",
    )
    for noisy in ("httpx", "httpcore", "urllib3", "filelock"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    # bitsandbytes logs a warning on every 8-bit matmul (100k lines per job): keep its errors only
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)

"""The `jobs` / `gpujobs` command line: the entry point. The group, its exit codes (a contract for scripts; see
README) and the shared helpers are in `api/cli_base.py`; the commands in `api/cli_submit.py`, `api/cli_jobs.py`,
`api/cli_adapters.py`, `api/cli_models.py` and `api/cli_stack.py`, each registered on the group when imported here.
"""

from __future__ import annotations

import os
import sys

from api import cli_adapters, cli_jobs, cli_models, cli_stack, cli_submit  # noqa: F401  (registers the commands)
from api.cli_base import cli


def main() -> None:
    name = os.path.basename(sys.argv[0])
    cli(prog_name=name if name in ("jobs", "gpujobs") else "gpujobs")

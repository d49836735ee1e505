"""`python -m api` is the `jobs` command (for environments without the console script)."""

from api.cli import main

main()

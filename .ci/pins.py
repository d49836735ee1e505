"""Check that this Python environment holds exactly the versions pinned in the constraints files given.

    .ci-venv/bin/python .ci/pins.py constraints.txt [override.txt ...]

Later files win for the packages they name (constraints-transformers517.txt over constraints.txt). Every installed
distribution must be pinned, at its pinned version, except pip (the venv's own), torch (pinned on .ci/run's pip
command line) and gpujobs itself. Where two folders on sys.path hold one package (.ci-venv517 is an overlay on
.ci-venv: .ci/run), the one this interpreter imports counts: the first. `pip install -c` takes a package that no
constraint names at its newest version: without this check a new dependency would slip into CI unpinned, and CI
would no longer say what it tested. Exit status 0 when everything is pinned, 1 with the list otherwise. Standard
library only.
"""

from __future__ import annotations

import re
import sys
from importlib import metadata
from pathlib import Path

NOT_PINNED_HERE = {"pip", "torch", "gpujobs"}


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def read_pins(files: list[Path]) -> dict[str, str]:
    pins: dict[str, str] = {}
    for path in files:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            name, sep, version = line.partition("==")
            if not sep or not version.strip():
                raise SystemExit(f"{path}:{number}: {line!r} is not a pin: write NAME==VERSION")
            pins[canonical(name)] = version.strip()
    return pins


def problems(pins: dict[str, str]) -> list[str]:
    found, seen = [], set()
    for dist in metadata.distributions():  # in sys.path's order: the first of a name is the one imported
        name = canonical(dist.metadata["Name"])
        if name in NOT_PINNED_HERE or name in seen:
            continue
        seen.add(name)
        if name not in pins:
            found.append(f"{dist.metadata['Name']}=={dist.version} is installed but not pinned")
        elif pins[name] != dist.version:
            found.append(f"{dist.metadata['Name']}=={dist.version} is installed but pinned at {pins[name]}")
    return sorted(found)


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    found = problems(read_pins([Path(a) for a in argv]))
    for line in found:
        print(f"pins: {line}", file=sys.stderr)
    if found:
        print(
            f"{len(found)} package(s) differ from {', '.join(argv)}: pin each one there (the version CI installed "
            "is the one to pin, after reading its changes), see the header of constraints.txt",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

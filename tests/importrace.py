"""An import hook that makes issue 27's start-up import race happen whenever a process gives it the chance
(tests/test_preload.py).

torch._dynamo and torch._inductor import each other. When one thread starts importing one of them while another
thread is inside the other, each waits on a module lock the other holds; CPython breaks that deadlock by handing one
thread the other's half-imported module, that thread's import fails, and what it leaves in sys.modules makes every
later import of transformers' Trainer or modeling code fail in the process ("partially initialized module
'torch._dynamo' has no attribute 'utils'"). Unforced, the window is milliseconds wide and a race needs luck.

`install()` puts `Gate` first on sys.meta_path. It finds nothing itself; it only holds the first thread that starts
one of the two packages (not from inside the other) up to HOLD seconds, while the process has another thread, for
a second thread to start the other one. A process that imports them from two threads at about the same time then
races every time; one that imports them in one thread before starting others is never held (a lone thread is not
waited for) and never races. Each release is printed on stderr ("importrace: ..."), so a test reads from the log
whether two threads imported them at once.

    python -c "from tests import importrace; importrace.run('worker.main')" --slice ''
"""

from __future__ import annotations

import importlib.machinery
import runpy
import sys
import threading

PAIR = ("torch._dynamo", "torch._inductor")
HOLD = 5.0  # seconds a thread that starts one of the two waits for another thread to start the other
MARK = "importrace: "  # what a release prints, first on its line


class Gate:
    """First on sys.meta_path: for the two packages of PAIR, the spec the path finder gives, with a loader that may
    hold the importing thread before it runs the package's code (`_Held`). Held there, the thread holds the
    package's module lock, as a thread slowly running the package's code would; not in find_spec, which CPython
    calls under its global import lock (every other thread's imports would wait too)."""

    def __init__(self) -> None:
        self.entered = {name: threading.Event() for name in PAIR}
        self.local = threading.local()

    def find_spec(self, name, path=None, target=None):
        if name not in PAIR:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None:
            spec.loader = _Held(self, name, spec.loader)
        return spec

    def hold(self, name: str) -> None:
        """Called by the thread that starts `name`: hold it up to HOLD seconds, while the process has another thread,
        for a second thread to start the other package (unless this thread started that one itself: nested)."""
        other = PAIR[1 - PAIR.index(name)]
        mine = getattr(self.local, "started", frozenset())
        self.local.started = mine | {name}
        self.entered[name].set()
        if other not in mine and threading.active_count() > 1 and self.entered[other].wait(HOLD):
            line = f"{MARK}thread {threading.current_thread().name!r} started {name} while another started {other}"
            sys.stderr.write(line + "\n")  # one write: two threads' lines never interleave
            sys.stderr.flush()


class _Held:
    def __init__(self, gate: Gate, name: str, loader) -> None:
        self.gate, self.name, self.loader = gate, name, loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        module.__loader__ = module.__spec__.loader = self.loader
        self.gate.hold(self.name)
        self.loader.exec_module(module)


def install() -> Gate:
    gate = Gate()
    sys.meta_path.insert(0, gate)
    return gate


def run(module: str) -> None:
    """Run `module` as `python -m module` would, with the gate installed (its arguments: sys.argv[1:])."""
    install()
    sys.argv[0] = module
    runpy.run_module(module, run_name="__main__", alter_sys=True)

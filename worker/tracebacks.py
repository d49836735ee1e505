"""Where a thread is, for the stall watchdog (worker/runtime.py `_on_stall`): the engine thread's stack read from the
heartbeat thread (`thread_stack`), and in one line (`stuck_at`), its innermost frame and the innermost in this
project's code, which the `stall` event and the worker's registration show. An engine thread that waits on the
committer (worker/committer.py) is stuck where the commit is: `thread_named` finds that thread.
"""

from __future__ import annotations

import sys
import threading
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def thread_stack(ident: int | None) -> str:
    """The current stack of thread `ident` (the engine thread, read from the heartbeat thread), innermost last."""
    frame = sys._current_frames().get(ident) if ident is not None else None
    if frame is None:
        return "(the thread is gone)\n"
    return "".join(traceback.format_stack(frame))


def thread_named(prefix: str) -> int | None:
    """The ident of a live thread whose name starts with `prefix` (the committer's: `committer-`), or None."""
    return next((t.ident for t in threading.enumerate() if t.name.startswith(prefix)), None)


def stuck_at(stack: str) -> str:
    """Where the engine thread is, in one line: its innermost frame, and the innermost in this project's code when
    that is another (`threading.py:359 in wait, from worker/faults.py:71 in _hang`)."""
    frames = [line.strip() for line in stack.splitlines() if line.strip().startswith('File "')]
    if not frames:
        return "an unknown place"
    described = [_frame_text(f) for f in frames]
    ours = [d for f, d in zip(frames, described) if f'"{ROOT}/' in f and "-packages/" not in f]
    innermost = described[-1]
    return innermost if not ours or ours[-1] == innermost else f"{innermost}, from {ours[-1]}"


def _frame_text(line: str) -> str:
    """`File "/x/worker/faults.py", line 71, in _hang` -> `worker/faults.py:71 in _hang`."""
    try:
        path, rest = line.removeprefix('File "').split('", line ', 1)
        number, func = rest.split(", in ", 1)
    except ValueError:
        return line
    path = path.removeprefix(f"{ROOT}/") if path.startswith(f"{ROOT}/") else Path(path).name
    return f"{path}:{number} in {func}"

"""Engine progress, for the stall watchdog: what the engine last did, when, and how long its steps take.

The runtime (worker/runtime.py) owns one `Progress` and passes it down, next to `should_stop`, to the generation
engines (worker/engines/) and the fine-tune (worker/training/finetune.py, worker/training/distributed.py). They
call `beat(kind)` at each unit of work (a decode step, a prefill chunk, a training step) and the runtime after each
micro-batch it hands to its committer (worker/committer.py: beats come from the engine's thread only, so a stall
report says what the engine last did); one-off long phases (loading a model, compiling, capturing CUDA graphs) run inside
`phase(name)`. The heartbeat thread renews a shard's lease only while `stalled()` is None: progress, not liveness,
holds a lease.

The bound:

- steps: `JOBS_STALL_SECONDS`, or with `auto` (the default) the larger of `FLOOR_S` and `MEDIAN_FACTOR` times the
  median of the last `WINDOW` gaps between beats (gaps that ended a phase are not steps and are not counted);
- inside a phase: `JOBS_STALL_PHASE_SECONDS` (default 30 min): a compile or a load is progress, but not forever.

`beat` is on the hot path (the fast engine runs about 100 decode steps a second on a GPU): one clock read and a few
attribute writes, no lock. The heartbeat thread reads those attributes without a lock too; the order of the writes
(`begin` sets the phase before the time, `end` the time before the phase) means a torn read can only make the
bound larger for one check, never report a stall that is not one.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass

log = logging.getLogger(__name__)

FLOOR_S = 120.0  # the auto bound is never below this: a step that takes minutes is slow, not hung
MEDIAN_FACTOR = 50  # ... and otherwise this many typical steps
WINDOW = 256  # gaps between beats kept for the median


@dataclass(frozen=True)
class Stall:
    """No progress for `seconds` (past `bound`) while the engine was `doing` this."""

    doing: str
    seconds: float
    bound: float
    phase: str | None
    beats: int
    median_step_s: float | None

    def describe(self) -> str:
        return f"no progress for {self.seconds:.1f} s (bound {self.bound:.0f} s) {self.doing}"


class Progress:
    def __init__(self, clock=time.monotonic) -> None:
        self._clock = clock
        self.start()

    def start(self, what: str = "the start") -> None:
        """A new unit of watched work (a claimed shard): the clock starts now, the step window is emptied."""
        self._ring = [0.0] * WINDOW
        self._gaps = 0
        self.beats = 0
        self.kind = what
        self.phase_name: str | None = None
        self.phase_since = 0.0
        self.last = self._clock()

    # --- called by the engines (hot path) ----------------------------------------------------------------------

    def beat(self, kind: str) -> None:
        """One unit of work done: `kind` is what it was ("decode step", "prefill chunk", "training step", …)."""
        t = self._clock()
        if self.phase_name is None:
            self._ring[self._gaps % WINDOW] = t - self.last
            self._gaps += 1
        self.beats += 1
        self.kind = kind
        self.last = t

    def begin(self, name: str) -> None:
        """A one-off long phase starts ("loading model", "compiling", "capturing CUDA graphs")."""
        self.phase_name = name
        self.phase_since = self.last = self._clock()
        log.info("progress: %s", name)
        self.phase_changed()

    def end(self) -> None:
        """The phase ended: that is progress (and its length is not a step's)."""
        self.last = self._clock()
        if self.phase_name is not None:
            log.info("progress: %s done in %.1f s", self.phase_name, self.last - self.phase_since)
        self.phase_name = None
        self.phase_changed()

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """`begin(name)` … `end()`; a phase inside another returns to the outer one when it ends."""
        outer, outer_since = self.phase_name, self.phase_since
        self.begin(name)
        try:
            yield
        finally:
            self.end()
            if outer is not None:
                self.phase_name, self.phase_since = outer, outer_since
                self.phase_changed()

    def phase_changed(self) -> None:
        """Called after every change of `phase_name` (a subclass passes phases on: worker/training/rank.py)."""

    # --- read by the heartbeat thread ----------------------------------------------------------------------------

    def median_step(self) -> float | None:
        gaps = sorted(self._ring[: min(self._gaps, WINDOW)])
        return gaps[len(gaps) // 2] if gaps else None

    def bound(self, stall_seconds: float | None, phase_seconds: float) -> float:
        """Seconds without progress that make a stall now (in a phase: the phase bound)."""
        if self.phase_name is not None:
            return max(phase_seconds, stall_seconds or FLOOR_S)
        if stall_seconds is not None:
            return stall_seconds
        median = self.median_step()
        return max(FLOOR_S, MEDIAN_FACTOR * median) if median is not None else FLOOR_S

    def doing(self) -> str:
        """What the engine is doing, in words: the phase, or the last unit of work done."""
        if self.phase_name is not None:
            return f"in phase {self.phase_name!r} (for {self._clock() - self.phase_since:.0f} s)"
        if self.beats == 0:
            return f"since {self.kind}"
        return f"since the last {self.kind} ({self.beats} progress report{'s' if self.beats != 1 else ''} so far)"

    def stalled(self, stall_seconds: float | None, phase_seconds: float) -> Stall | None:
        """A Stall if the engine made no progress within the bound, else None."""
        phase = self.phase_name
        bound = self.bound(stall_seconds, phase_seconds)
        seconds = self._clock() - self.last
        if seconds <= bound:
            return None
        return Stall(
            doing=self.doing(),
            seconds=seconds,
            bound=bound,
            phase=phase,
            beats=self.beats,
            median_step_s=self.median_step(),
        )

    def report(self, stall_seconds: float | None, phase_seconds: float) -> dict:
        """What the worker's registration shows while it runs a shard (`gpujobs workers --json`)."""
        median = self.median_step()
        return {
            "doing": self.doing(),
            "idle_s": round(self._clock() - self.last, 1),
            "beats": self.beats,
            "median_step_s": median and round(median, 4),
            "stall_bound_s": round(self.bound(stall_seconds, phase_seconds), 1),
        }

"""Supervised workers: one worker process per GPU slice, restarted when it exits, within limits.

Who runs a `Supervisor`:

- the foreground `gpujobs up`, in its own process;
- `gpujobs up --detach`, through a process of its own (`python -m api.stack`) that outlives `up`;
  its pid is in stack.json and `gpujobs down` stops it first;
- `gpujobs supervise --gpus ...` (ops/launch-workers.sh starts one per slice on a bare host).

In "stack" mode (the two `up` cases) the supervisor owns the stack: when it is asked to stop (SIGINT, SIGTERM or
SIGHUP, whatever dispositions it inherited), or when Redis or the API exits, it stops its workers first (they hand
their shards back), then the API, then Redis, and removes stack.json. It never restarts a worker while stopping.

Restart policy (settings `JOBS_RESTART_*`): a worker that exits is started again after a backoff of
JOBS_RESTART_BACKOFF seconds (1), doubling with each exit in the window up to JOBS_RESTART_BACKOFF_MAX (60); a slot
whose worker exited JOBS_RESTART_LIMIT times (5) within JOBS_RESTART_WINDOW seconds (600) stays down. A
configuration error (exit 2, 5, 6, 77 or 78) will not heal by itself: its slot stays down at once. The reason is
written on the worker's registration (`gpujobs workers` shows it), the new worker's registration counts its slot's
restarts (JOBS_WORKER_RESTARTS), and /metrics exports them (gpujobs_worker_restarts_total).

Worker exit codes: core/exits.py (a contract with README and the systemd unit's RestartPreventExitStatus); a
negative code is the signal that killed the worker (SIGKILL: out of memory, kill -9), restarted.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from core import registry
from core.db import session_scope
from core.exits import CONFIGURATION, describe
from core.logs import setup_logging
from core.settings import get_settings
from core.slices import parse_slices, worker_command, worker_env

log = logging.getLogger("supervisor")


def _span(seconds: float) -> str:
    return f"{seconds / 60:g} min" if seconds >= 60 else f"{seconds:g} s"


@dataclass(frozen=True)
class Policy:
    limit: int = 5
    window: float = 600.0
    backoff: float = 1.0
    backoff_max: float = 60.0

    @classmethod
    def from_settings(cls) -> Policy:
        s = get_settings()
        return cls(
            limit=s.restart_limit, window=s.restart_window, backoff=s.restart_backoff, backoff_max=s.restart_backoff_max
        )


def decide(code: int, exits: list[float], t: float, policy: Policy, hint: str) -> tuple[float | None, str]:
    """What to do about a worker that exited `code` at `t` (`exits`: its slot's exit times, this one included):
    (seconds to wait before starting it again, or None when its slot stays down; the outcome in words)."""
    if code in CONFIGURATION:
        return None, f"a configuration error, not restarted: fix it, then {hint}"
    recent = [e for e in exits if t - e <= policy.window]
    if len(recent) >= policy.limit:
        return None, (
            f"exited {len(recent)} times in {_span(policy.window)}, last exit {code} ({describe(code)}): "
            f"stays down; fix the cause, then {hint}"
        )
    delay = min(policy.backoff * 2 ** (len(recent) - 1), policy.backoff_max)
    return delay, f"restarting in {delay:g} s"


@dataclass
class Slot:
    """One GPU slice and the worker process that serves it."""

    index: int
    devices: list[str]
    proc: subprocess.Popen | None = None
    restarts: int = 0
    exits: list[float] = field(default_factory=list)
    restart_at: float | None = None
    down: str | None = None  # why it stays down

    @property
    def slice(self) -> str:
        return ",".join(self.devices)

    @property
    def label(self) -> str:
        return f"slice {self.slice or 'none (CPU)'}"

    def view(self) -> dict[str, Any]:
        state = "down" if self.down else "running" if self.proc else "restarting"
        return {
            "slice": self.slice,
            "pid": self.proc.pid if self.proc else None,
            "restarts": self.restarts,
            "state": state,
            "reason": self.down,
        }


class Supervisor:
    """Starts one worker per slice and, on each `step()`, restarts the ones that exited (see the module docstring).

    `logs_dir`: each slot's output goes to logs_dir/worker-<index>.log (appended across restarts); None: this
    process's stdout/stderr. `hint`: how the user restarts a slot that stays down. `on_change`: called after every
    start and exit (the stack writes its pids to stack.json)."""

    def __init__(
        self,
        slices: list[list[str]],
        *,
        env: dict[str, str],
        logs_dir: Path | None,
        hint: str,
        policy: Policy | None = None,
        on_change: Callable[[Supervisor], None] | None = None,
    ):
        self.slots = [Slot(i, devices) for i, devices in enumerate(slices)]
        self.env, self.logs_dir, self.hint = env, logs_dir, hint
        self.policy = policy or Policy.from_settings()
        self.on_change = on_change or (lambda _: None)
        self.host = get_settings().hostname or socket.gethostname()
        self.stopping = False

    def start(self) -> None:
        for slot in self.slots:
            self._spawn(slot)

    def pids(self) -> list[int]:
        return [s.proc.pid for s in self.slots if s.proc]

    def view(self) -> list[dict[str, Any]]:
        return [s.view() for s in self.slots]

    def all_down(self) -> bool:
        return all(s.down for s in self.slots)

    def step(self) -> None:
        """Notice workers that exited; start the ones whose backoff is over."""
        t = time.time()
        for slot in self.slots:
            code = slot.proc.poll() if slot.proc else None
            if code is not None:
                self._exited(slot, code, t)
            if slot.restart_at is not None and t >= slot.restart_at and not self.stopping:
                slot.restart_at = None
                slot.restarts += 1
                self._spawn(slot)

    def stop(self, timeout: float = 30.0) -> list[tuple[Slot, int, int]]:
        """SIGTERM every worker (each hands its shard back), SIGKILL those still running after `timeout` seconds.
        Never restarts one afterwards. Returns (slot, pid, exit status) of each worker it stopped."""
        self.stopping = True
        live = [s for s in self.slots if s.proc and s.proc.poll() is None]
        for slot in self.slots:
            slot.restart_at = None
        for slot in live:
            _signal(slot.proc, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while any(s.proc.poll() is None for s in live) and time.monotonic() < deadline:
            time.sleep(0.2)
        stopped = []
        for slot in live:
            reason = "stopped on request"
            if slot.proc.poll() is None:
                log.warning("worker %s (pid %s) did not stop in %.0f s: killing it", slot.label, slot.proc.pid, timeout)
                _signal(slot.proc, signal.SIGKILL)
                reason = f"did not stop within {timeout:.0f} s of SIGTERM: killed"
            code = slot.proc.wait()
            self._record(slot, slot.proc.pid, code, reason, None)
            stopped.append((slot, slot.proc.pid, code))
            slot.proc = None
        self.on_change(self)
        return stopped

    # --- one slot ----------------------------------------------------------------------------------------

    def _spawn(self, slot: Slot) -> None:
        env = dict(worker_env(slot.devices, self.env), JOBS_WORKER_RESTARTS=str(slot.restarts))
        out = open(self.logs_dir / f"worker-{slot.index}.log", "ab") if self.logs_dir else None
        try:
            slot.proc = subprocess.Popen(
                worker_command(slot.devices),
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT if out else None,
                start_new_session=True,
            )
        finally:
            if out:
                out.close()
        what = f"restart {slot.restarts}" if slot.restarts else "started"
        log.info("worker %s: pid %s (%s)", slot.label, slot.proc.pid, what)
        self.on_change(self)

    def _exited(self, slot: Slot, code: int, t: float) -> None:
        pid, slot.proc = slot.proc.pid, None
        slot.exits.append(t)
        delay, outcome = decide(code, slot.exits, t, self.policy, self.hint)
        if delay is None:
            slot.down = f"exit {code} ({describe(code)}): {outcome}"
            log.error("worker %s (pid %s) exited %s (%s): %s", slot.label, pid, code, describe(code), outcome)
        else:
            slot.restart_at = t + delay
            log.warning("worker %s (pid %s) exited %s (%s): %s", slot.label, pid, code, describe(code), outcome)
        reason = "stopped without being asked to" if code == 0 else describe(code)
        self._record(slot, pid, code, reason, None if delay is not None else outcome)
        self.on_change(self)

    def _record(self, slot: Slot, pid: int, code: int, reason: str, outcome: str | None) -> None:
        """Write the exit on the worker's registration (one it never made, if it exited before registering). The
        store may be down: supervision goes on, and the log has the line."""
        try:
            with session_scope() as session:
                if registry.find(session, host=self.host, pid=pid) is None:
                    registry.never_registered(
                        session,
                        host=self.host,
                        pid=pid,
                        slice=slot.slice,
                        exit_code=code,
                        reason="; ".join(r for r in (reason, outcome) if r),
                        restarts=slot.restarts,
                    )
                else:
                    registry.exited(session, host=self.host, pid=pid, exit_code=code, reason=reason, outcome=outcome)
        except Exception:  # noqa: BLE001 - any store error: the supervisor must keep supervising
            log.exception("could not record the exit of worker pid %s", pid)


def _signal(proc: subprocess.Popen, sig: signal.Signals) -> None:
    try:
        proc.send_signal(sig)
    except ProcessLookupError:
        pass


class StopSignals:
    """SIGINT, SIGTERM and SIGHUP ask this process to stop, whatever dispositions it inherited.

    A process started in the background by a non-interactive shell inherits SIGINT as ignored, and Python then
    installs no KeyboardInterrupt handler: such an `up` never saw its Ctrl-C. The handlers only note the signal;
    loops check `requested` at safe points (never half-way through starting a process, which could leave an
    orphan). A second signal while stopping is noted in the log: stopping continues."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

    def __init__(self, say: Callable[[str], None] = log.warning):
        self.received: str | None = None
        self.say = say
        self.previous: dict[int, Any] = {}

    def install(self) -> StopSignals:
        for sig in self.SIGNALS:
            self.previous[sig] = signal.signal(sig, self._handle)
        return self

    def restore(self) -> None:
        """Give the signals back (`up --detach` returns to a caller such as `gpujobs demo`)."""
        for sig, handler in self.previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)

    def _handle(self, signum: int, _frame) -> None:
        if self.received is not None:
            self.say(f"{signal.Signals(signum).name}: already stopping (workers hand their shards back first)")
            return
        self.received = signal.Signals(signum).name

    def requested(self) -> bool:
        return self.received is not None


# --- the process: `python -m api.supervisor` / `gpujobs supervise` ------------------------------------------------


def supervise(slices: list[list[str]], *, stop_timeout: float) -> int:
    """`gpujobs supervise`: run the slices' workers in the foreground until asked to stop. 0 when stopped, 1 when
    every slot stays down (the log says why)."""
    signals = StopSignals().install()
    hint = "start this supervisor again (ops/launch-workers.sh stop SLICE, then start it)"
    sup = Supervisor(slices, env=dict(os.environ), logs_dir=None, hint=hint)
    sup.start()
    while not signals.requested() and not sup.all_down():
        sup.step()
        time.sleep(0.5)
    if signals.requested():
        log.info("%s: stopping %d worker(s)", signals.received, len(sup.pids()))
        sup.stop(stop_timeout)
        return 0
    log.error("every worker stays down: %s", "; ".join(s.down or "" for s in sup.slots))
    return 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m api.supervisor", description=__doc__.split("\n")[0])
    parser.add_argument("--gpus", required=True, help="slices, ';' between workers ('0,1;2'; 'none' = a CPU worker)")
    parser.add_argument("--stop-timeout", type=float, default=30.0, help="seconds a worker gets to stop")
    args = parser.parse_args(argv)
    setup_logging("INFO")
    return supervise(parse_slices(args.gpus), stop_timeout=args.stop_timeout)


if __name__ == "__main__":
    sys.exit(main())

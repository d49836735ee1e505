"""A generation shard's commits on a thread of their own (issue 25): the engine hands each micro-batch over and goes
on decoding while SQL writes the one before.

Before, the runner committed each micro-batch inline: the engine's generator stayed suspended during the commit, and
the GPU idled once the step it had launched was done. Now `put` returns at once while fewer than DEPTH batches wait
(more block it: memory stays bounded, and a slow store slows the engine instead of piling rows up). The order of
commits is the order of `put`. What the runner did after each commit (count rows, note the first result, beat the
progress clock, stop at a yield's boundary) runs on this thread, in `commit`.

Failures: `commit` returning False (the job is stopping) or raising (the lease was lost, the store failed) stops
the commits: the batches still waiting are dropped, as the runner dropped the rest of the engine's output before,
and `stopped` (False returned) or the exception (raised again by the next `put` and by `close`) tell the engine
thread. `close` waits until every batch handed over is committed or dropped: the runner decides the shard's fate
(complete, hand back, yield) only after it. A process killed meanwhile loses the batches not yet committed, like
rows not yet generated: the shard's next attempt runs every pending row.

Threads and imports (worker/preload.py): this thread imports nothing; what it calls (core.leases, SQLAlchemy) the
main thread imported at start-up.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

DEPTH = 4  # micro-batches handed over and not yet committed, at most


class Committer:
    def __init__(self, commit: Callable[[Any], bool], name: str = "committer"):
        self.commit = commit
        self.stopped = False  # `commit` returned False: the job is stopping
        self.error: BaseException | None = None
        self._queue: queue.Queue = queue.Queue(maxsize=DEPTH)
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    @property
    def halted(self) -> bool:
        """No later batch will be committed: the engine may stop."""
        return self.stopped or self.error is not None

    def put(self, batch: Any) -> None:
        """Hand `batch` over (blocks while DEPTH wait); raises what an earlier commit raised."""
        self._raise()
        self._queue.put(batch)

    def close(self) -> None:
        """Wait until every batch handed over is committed (or dropped after a failure); raises what a commit
        raised."""
        self._queue.put(None)
        self._thread.join()
        self._raise()

    def _raise(self) -> None:
        if self.error is not None:
            raise self.error

    def _loop(self) -> None:
        while (batch := self._queue.get()) is not None:
            if self.halted:
                continue  # dropped: the job is stopping, or the shard is no longer this worker's
            try:
                self.stopped = not self.commit(batch)
            except BaseException as exc:  # noqa: BLE001  handed to the engine thread, which raises it
                self.error = exc

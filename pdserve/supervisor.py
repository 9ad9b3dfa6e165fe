"""Child processes kept alive: a dead one is started again with backoff, the rest keep serving.

`pdserve up` runs the router and its workers through this. A child that exits while the
supervisor is not stopping is restarted after a delay that doubles with each quick death
(`min_backoff` up to `max_backoff`) and resets once the child has stayed up for `stable_after`
seconds. Every restart is logged with the exit status. `stop()` drains the workers first (SIGTERM,
so their in-flight requests finish), then the router.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Child:
    name: str
    argv: list[str]
    core: tuple[int, ...] | None = None  # pinned to these CPU cores
    popen: subprocess.Popen | None = None
    started_at: float = 0.0
    restarts: int = 0
    backoff: float = 0.0
    restart_at: float | None = None  # when a dead child is due to start again
    history: list[int] = field(default_factory=list)  # exit statuses, oldest first

    @property
    def pid(self) -> int | None:
        return self.popen.pid if self.popen is not None else None


class Supervisor:
    def __init__(self, children: Sequence[tuple[str, list[str], tuple[int, ...] | None]], env: dict[str, str], *,
                 min_backoff: float = 1.0, max_backoff: float = 30.0, stable_after: float = 60.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.children = [Child(name, list(argv), core) for name, argv, core in children]
        self.env = env
        self.min_backoff, self.max_backoff, self.stable_after = min_backoff, max_backoff, stable_after
        self._clock = clock

    def start(self) -> Supervisor:
        for child in self.children:
            self._spawn(child)
        return self

    def poll(self) -> list[Child]:
        """Restart what died (when its backoff has passed); returns the children restarted now."""
        now = self._clock()
        restarted = []
        for child in self.children:
            if child.restart_at is None:
                status = child.popen.poll() if child.popen is not None else 0
                if status is None:
                    continue
                child.history.append(status)
                quick = now - child.started_at < self.stable_after
                child.backoff = min(self.max_backoff, max(self.min_backoff, child.backoff * 2)) if quick \
                    else self.min_backoff
                child.restart_at = now + child.backoff
                log.warning("%s (pid %s) exited with status %s; restarting in %.1f s", child.name, child.pid,
                            status, child.backoff)
            elif now >= child.restart_at:
                child.restarts += 1
                self._spawn(child)
                log.warning("%s restarted (pid %d, restart %d)", child.name, child.pid, child.restarts)
                restarted.append(child)
        return restarted

    def stop(self, timeout: float = 30.0) -> None:
        """Workers drain first (so in-flight requests finish), then the router stops."""
        workers = [c for c in self.children if c.name != "router"]
        routers = [c for c in self.children if c.name == "router"]
        for group in (workers, routers):
            live = [c.popen for c in group if c.popen is not None and c.popen.poll() is None]
            for p in live:
                p.send_signal(signal.SIGTERM)
            deadline = time.time() + timeout
            for p in live:
                try:
                    p.wait(max(0.1, deadline - time.time()))
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()

    def _spawn(self, child: Child) -> None:
        pre = (lambda c=child.core: os.sched_setaffinity(0, set(c))) if child.core is not None else None
        child.popen = subprocess.Popen(child.argv, preexec_fn=pre, start_new_session=True, env=self.env)
        child.started_at = self._clock()
        child.restart_at = None
        log.info("started %s (pid %d%s)", child.name, child.pid,
                 f", cores {','.join(map(str, child.core))}" if child.core is not None else "")

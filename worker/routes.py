"""Which router each request belongs to, and each router's epoch, as the engine loop sees them.

A worker serves several routers at once (worker/router_links.py). Every request it holds was
given to it by one of them, and only that router may see its tokens, abort it, or lose it:

    work from router R      -> claim(request_id, R)   (refused if another router holds the id)
    KV of router epoch E    -> router_for_epoch(E) = R -> claim(request_id, R)
    TokenEvents             -> split(): each event to its request's router; unknown ids: dropped
    Abort from R            -> abortable(R, ids): R's ids and unclaimed ones, never another's
    Fence from R            -> fence(R, epoch): R's requests are released and returned to drop
    the worker's loop       -> retain(ids it still holds): finished requests are forgotten

A router is known here from its first Fence (its first epoch) until `forget`. Engine thread only.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence

from pdserve.config.log_limits import RateLimitedLog
from pdserve.protocol.messages import TokenEvent

log = logging.getLogger(__name__)
_log_refused = RateLimitedLog(log, logging.WARNING, per_seconds=10.0)


class RouteTable:
    """request id -> router (the link's address), and router -> its current epoch."""

    def __init__(self) -> None:
        self._owner: dict[str, str] = {}
        self._epoch: dict[str, str] = {}  # '' : registered without epochs, or lost
        self.unrouted = 0  # token events dropped: no router holds their request

    def claim(self, request_id: str, router: str) -> bool:
        """Record that `router` gave us `request_id`; False when another router already holds it."""
        owner = self._owner.setdefault(request_id, router)
        if owner != router:
            _log_refused("request %s from router %s refused: router %s holds that id", request_id, router, owner,
                         key="claim")
            return False
        return True

    def owner(self, request_id: str) -> str | None:
        return self._owner.get(request_id)

    def epoch_of(self, router: str | None) -> str:
        return self._epoch.get(router, "") if router is not None else ""

    def router_for_epoch(self, epoch: str) -> str | None:
        """The router we are registered with under `epoch`; None for any other (or no) epoch."""
        if not epoch:
            return None
        return next((r for r, e in self._epoch.items() if e == epoch), None)

    def requests_of(self, router: str) -> tuple[str, ...]:
        return tuple(rid for rid, r in self._owner.items() if r == router)

    def counts(self) -> dict[str, int]:
        """Requests per router. Safe from another thread (/info): the copy is one C-level call."""
        out: dict[str, int] = {}
        for router in list(self._owner.values()):
            out[router] = out.get(router, 0) + 1
        return out

    def fence(self, router: str, epoch: str) -> tuple[str, ...]:
        """`router` has a new epoch ('' : it is lost): its requests are released and returned."""
        self._epoch[router] = epoch
        ids = self.requests_of(router)
        for rid in ids:
            del self._owner[rid]
        return ids

    def forget(self, router: str) -> tuple[str, ...]:
        """`router` is gone for good: as `fence`, and the router itself is forgotten too."""
        ids = self.fence(router, "")
        self._epoch.pop(router, None)
        return ids

    def abortable(self, router: str, request_ids: Sequence[str]) -> tuple[str, ...]:
        """The ids of an Abort from `router` that it may abort: its own, and ids nobody holds (a
        decode worker's abort may precede the KV it names). Another router's stay untouched."""
        out = []
        for rid in request_ids:
            owner = self._owner.get(rid, router)
            if owner == router:
                out.append(rid)
            else:
                _log_refused("abort of request %s from router %s ignored: router %s holds it", rid, router, owner,
                             key="abort")
        return tuple(out)

    def split(self, events: Iterable[TokenEvent]) -> dict[str, list[TokenEvent]]:
        """Events grouped by the router of their request, in order; events of unknown ids dropped."""
        out: dict[str, list[TokenEvent]] = {}
        for ev in events:
            router = self._owner.get(ev.request_id)
            if router is None:
                self.unrouted += 1
                log.debug("event of request %s dropped: no router holds it", ev.request_id)
                continue
            out.setdefault(router, []).append(ev)
        return out

    def retain(self, held: Iterable[str]) -> None:
        """Forget every request the worker no longer holds (finished, aborted, handed off)."""
        keep = set(held)
        for rid in [rid for rid in self._owner if rid not in keep]:
            del self._owner[rid]

    def __len__(self) -> int:
        return len(self._owner)

"""A worker's links to every router it serves: `RouterLinks`, one `WorkerLink` per router.

The routers come from `--router-address` (config/router_address.py): fixed tcp:// addresses, and
dns:// names that a discovery thread resolves every `resolve_interval` seconds (getaddrinfo,
IPv4 and IPv6: a Kubernetes headless Service lists every router pod). A link opens when an
address first resolves and closes once the address has been gone for `forget_after` seconds
(longer than a router's drain, so a DNS hiccup or a draining router loses nothing).

To the engine loop this is what one WorkerLink was: `poll()`, `send_events()`, `registered`,
`alive`, `close()`. Underneath, every request belongs to the router it came from (RouteTable,
worker/routes.py): its tokens go to that router only, an Abort from router A touches only A's
requests, and a Fence (A restarted, went silent, or left DNS) carries exactly A's requests for
the worker to drop. Heartbeats go to every router: each routes from its own view.
"""

from __future__ import annotations

import collections
import logging
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import replace

import msgspec

from pdserve.config.log_limits import RateLimitedLog
from pdserve.config.router_address import RouterAddress, endpoint
from pdserve.protocol.auth import FrameAuth
from pdserve.protocol.messages import (
    Abort,
    GenerateRequest,
    Heartbeat,
    PrefillRequest,
    Register,
    TokenEvent,
    TokenEvents,
)
from pdserve.worker.router_link import Fence, Work, WorkerLink
from pdserve.worker.routes import RouteTable

log = logging.getLogger(__name__)
_log_dns = RateLimitedLog(log, logging.WARNING, per_seconds=30.0)

ROUTER_FORGET_AFTER = 60.0  # seconds an address may be missing from DNS before its link closes


def resolve(name: str, port: int) -> set[str]:
    """The ZMQ endpoints of every address `name` resolves to (IPv4 and IPv6); raises OSError."""
    infos = socket.getaddrinfo(name, port, 0, socket.SOCK_STREAM)
    return {endpoint(str(sockaddr[0]), port) for family, _, _, _, sockaddr in infos
            if family in (socket.AF_INET, socket.AF_INET6)}


class RouterLinks:
    """Registration, heartbeats and per-router ownership of work across every router.

    `poll()` and `send_events()` belong to the engine thread; `registered` and `alive` may be read
    from any thread (the health server's). The discovery thread alone opens and closes links.
    """

    def __init__(
        self,
        addresses: Sequence[RouterAddress],
        heartbeat_fn: Callable[[], Heartbeat],
        heartbeat_interval: float = 1.0,
        *,
        auth: FrameAuth | None = None,
        resolve_interval: float = 5.0,
        forget_after: float = ROUTER_FORGET_AFTER,
        on_ready: Callable[[], None] | None = None,
    ) -> None:
        self.addresses = tuple(addresses)
        self.on_ready = on_ready  # each link calls it when work lands (WorkerLink)
        self.heartbeat_fn = heartbeat_fn
        self.heartbeat_interval = heartbeat_interval
        self.auth = auth
        self.resolve_interval = resolve_interval
        self.forget_after = forget_after
        self.routes = RouteTable()
        self.register: Register | None = None
        # Replaced whole by the discovery thread, never mutated: readers take the reference once.
        self._links: dict[str, WorkerLink] = {}
        self._seen: dict[str, float] = {}  # endpoint -> monotonic time it last resolved
        self._resolved: dict[RouterAddress, set[str]] = {}  # each dns:// name's last good answer
        self._gone: collections.deque[str] = collections.deque()  # closed links, for poll() to fence
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # --- lifecycle -----------------------------------------------------------------------------

    def start(self, register: Register) -> RouterLinks:
        """Open a link to every fixed address now, and resolve the dns:// ones (on a thread)."""
        self.register = register  # each link draws its own incarnation (fences renew it per router)
        if any(a.scheme == "dns" for a in self.addresses):
            self._thread = threading.Thread(target=self._discover, name=f"router-dns-{register.worker_id}",
                                            daemon=True)
            self._thread.start()
        else:
            self.refresh()
        return self

    def close(self) -> None:
        """Stop resolving; every link says Goodbye and stops."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5.0)
        links, self._links = self._links, {}
        for link in links.values():
            link.close()

    def links(self) -> dict[str, WorkerLink]:
        """The open links by router endpoint (a snapshot)."""
        return dict(self._links)

    @property
    def registered(self) -> bool:
        """Registered with at least one router whose link is up."""
        return any(link.alive and link.registered for link in self._links.values())

    @property
    def alive(self) -> bool:
        """False once the discovery thread or a link's I/O thread died: some router stopped
        hearing from us. (No router yet is not dead: `registered` says that.)"""
        if self._thread is not None and not self._thread.is_alive() and not self._stop.is_set():
            return False
        return all(link.alive for link in self._links.values())

    def wait_registered(self, timeout: float) -> bool:
        """Wait until `registered` (tests and start-up logs; the loop never waits)."""
        deadline = time.monotonic() + timeout
        while not self.registered:
            links = list(self._links.values())
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            if links:
                links[0].wait_registered(min(remaining, 0.05))
            else:
                self._stop.wait(min(remaining, 0.05))
        return True

    def describe(self) -> list[dict]:
        """Each router's link, for /info."""
        counts = self.routes.counts()
        return [{"router": r, "registered": link.registered, "epoch": self.routes.epoch_of(r),
                 "requests": counts.get(r, 0), "fences": link.fences}
                for r, link in sorted(self._links.items())]

    # --- the engine's side ---------------------------------------------------------------------

    def poll(self) -> list[Work]:
        """Work every router sent since the last call, each router's in its order; never blocks.

        A Fence comes out carrying its router and exactly that router's requests (the worker drops
        those and no others); an Abort only the ids its router may abort."""
        out: list[Work] = []
        while self._gone:
            router = self._gone.popleft()
            ids = self.routes.forget(router)
            out.append(Fence(f"router {router} is gone from DNS", "", router=router, request_ids=ids))
        for router, link in self._links.items():
            for work in link.poll():
                routed = self._route(router, link, work)
                if routed is not None:
                    out.append(routed)
        return out

    def _route(self, router: str, link: WorkerLink, work: Work) -> Work | None:
        if isinstance(work, Fence):
            return replace(work, router=router, request_ids=self.routes.fence(router, work.epoch))
        if isinstance(work, Abort):
            ids = self.routes.abortable(router, work.request_ids)
            return msgspec.structs.replace(work, request_ids=ids) if ids else None
        if isinstance(work, PrefillRequest | GenerateRequest) and not self.routes.claim(work.request_id, router):
            error = TokenEvent(request_id=work.request_id, token_ids=(), finish_reason="error",
                               error="request id already in use on this worker", retry="refused")
            link.send_events(TokenEvents(worker_id=link.worker_id, events=(error,)))
            return None
        return work

    def send_events(self, events: TokenEvents) -> bool:
        """Queue one step's events, each to the router its request came from. False: some dropped
        (no router holds the request, or its router's outbox is full)."""
        links = self._links
        by_router = self.routes.split(events.events)
        ok = sum(len(evs) for evs in by_router.values()) == len(events.events)
        for router, evs in by_router.items():
            link = links.get(router)
            if link is None:  # closed since: its Fence is on its way
                ok = False
                continue
            ok = link.send_events(TokenEvents(worker_id=events.worker_id, events=tuple(evs))) and ok
        return ok

    def retain(self, held: Sequence[str] | set[str]) -> None:
        """Forget the routes of requests the worker no longer holds."""
        self.routes.retain(held)

    # --- discovery -----------------------------------------------------------------------------

    def _discover(self) -> None:
        while not self._stop.is_set():
            try:
                self.refresh()
            except Exception:  # a bug here must not leave the worker deaf to new routers
                log.exception("router discovery failed; retrying in %.1f s", self.resolve_interval)
            self._stop.wait(self.resolve_interval)

    def refresh(self, now: float | None = None) -> None:
        """Resolve every address once; open links to new routers, close those gone too long.
        A lookup that fails keeps its name's last answer (a DNS outage closes nothing)."""
        assert self.register is not None, "start() first"
        now = time.monotonic() if now is None else now
        current: set[str] = set()
        for address in self.addresses:
            if address.scheme == "tcp":
                current.add(endpoint(address.host, address.port))
                continue
            if address.scheme == "ipc":
                current.add(str(address))
                continue
            try:
                found = resolve(address.host, address.port)
            except OSError as exc:
                _log_dns("router address %s does not resolve (%s); keeping %d known routers", address, exc,
                         len(self._resolved.get(address, ())), key=f"dns-{address}")
                found = self._resolved.get(address, set())
            else:
                if found != self._resolved.get(address):
                    log.info("router address %s resolves to %s", address, ", ".join(sorted(found)) or "nothing")
            self._resolved[address] = found
            current |= found
        for ep in current:
            self._seen[ep] = now
        if self._stop.is_set():  # closing: open nothing more
            return
        links = dict(self._links)
        gone = {ep: links.pop(ep) for ep in list(links)
                if ep not in current and now - self._seen.get(ep, now) >= self.forget_after}
        for ep in sorted(current - set(links)):
            log.info("worker %s: new router %s", self.register.worker_id, ep)
            links[ep] = WorkerLink(ep, self.register, self.heartbeat_fn, self.heartbeat_interval,
                                   auth=self.auth, on_ready=self.on_ready).start()
        self._links = links
        for ep, link in gone.items():
            log.warning("worker %s: router %s has been gone from DNS for %.0f s; closing its link and "
                        "dropping its requests", self.register.worker_id, ep, now - self._seen.pop(ep, now))
            link.close()
            self._gone.append(ep)

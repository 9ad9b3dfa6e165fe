"""The forms of a worker's `--router-address`: whom it registers with (torch- and zmq-free).

    tcp://HOST:PORT                one router (HOST a name, an IPv4 address or [an IPv6 one])
    tcp://A:5550,tcp://B:5550      several routers: the worker registers with every one
    dns://NAME:PORT                every address NAME resolves to (IPv4 and IPv6), looked up again
                                   every --router-resolve-interval seconds: a Kubernetes headless
                                   Service over the routers' control port
    ipc:///ABSOLUTE/PATH           a router on this host, by its socket file (`pdserve up`)

Parsing only validates; resolving a dns:// name is the worker's (worker/router_links.py).
"""

from __future__ import annotations

import re
from typing import Literal, NamedTuple

from pdserve.config.engine import ConfigError

Scheme = Literal["tcp", "dns", "ipc"]

_FORM = re.compile(r"^(?P<scheme>tcp|dns)://(?:\[(?P<v6>[0-9A-Fa-f:.%\w-]+)\]|(?P<host>[A-Za-z0-9_.\-]+)):(?P<port>\d+)$")
_IPC = re.compile(r"^ipc://(?P<path>/[^\s,]+)$")
_FORMS = "tcp://HOST:PORT (comma-separated for several routers), dns://NAME:PORT or ipc:///PATH"


class RouterAddress(NamedTuple):
    """One entry of --router-address."""

    scheme: Scheme
    host: str  # an IPv6 address without its brackets; for ipc the socket file's path
    port: int  # 0 for ipc

    def __str__(self) -> str:
        if self.scheme == "ipc":
            return f"ipc://{self.host}"
        return f"{self.scheme}://{_host(self.host)}:{self.port}"


def endpoint(host: str, port: int) -> str:
    """The ZMQ endpoint of one router: tcp://HOST:PORT, an IPv6 host in brackets."""
    return f"tcp://{_host(host)}:{port}"


def _host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def parse_router_addresses(text: str) -> tuple[RouterAddress, ...]:
    """`--router-address` as its entries, in order, without repeats; ConfigError names a bad one."""
    out: list[RouterAddress] = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        if (ipc := _IPC.match(item)) is not None:
            if (local := RouterAddress("ipc", ipc["path"], 0)) not in out:
                out.append(local)
            continue
        m = _FORM.match(item)
        if m is None:
            raise ConfigError(f"--router-address: {item!r} is not {_FORMS}")
        port = int(m["port"])
        if not 0 < port < 65536:
            raise ConfigError(f"--router-address: {item!r}: port {port} is not in 1..65535")
        address = RouterAddress(m["scheme"], m["v6"] or m["host"], port)  # type: ignore[arg-type]
        if m["v6"] and (address.scheme == "dns" or ":" not in m["v6"]):
            raise ConfigError(f"--router-address: {item!r}: brackets hold an IPv6 address, and only in tcp://")
        if address not in out:
            out.append(address)
    if not out:
        raise ConfigError(f"--router-address is empty; use {_FORMS}")
    return tuple(out)

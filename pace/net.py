"""Addresses on this host: a free port, the address on the route to another host, and where the
rollout servers reach trainer rank 0 for the weight transfer."""
from __future__ import annotations

import socket
import sys


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the OS's pick; another process may take it before it is used)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def is_loopback(host: str | None) -> bool:
    """Whether ``host`` (a URL's host: a name or an address, IPv6 without brackets) names this host's
    loopback interface, which no other host reaches."""
    return host is not None and (host in ("localhost", "::1") or host.startswith("127."))


def source_address(host: str) -> str:
    """This host's IPv4 address on the route to ``host`` (a name or an address): the kernel's choice
    of source address for a UDP socket connected there (no packet is sent). Where a host has several
    addresses (`hostname -I` lists them in no stated order), this is the one ``host`` can reach."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, 9))
        return s.getsockname()[0]


def transfer_address(rollout_cfg) -> str:
    """Where the engines reach trainer rank 0 for nccl/gloo: `rollout.transfer_address`, else
    127.0.0.1 when every server is on this host (which no server on another host can reach: such a
    server cannot join the run: pace/rollout/healing.py `join`), else this host's address on the route
    to the first remote server."""
    from urllib.parse import urlparse

    if rollout_cfg.transfer_address:
        return rollout_cfg.transfer_address
    remote = [h for h in (urlparse(u).hostname for u in rollout_cfg.servers) if h and not is_loopback(h)]
    return source_address(remote[0]) if remote else "127.0.0.1"


if __name__ == "__main__":  # scripts/launch_slurm.sh: python -m pace.net HOST → this host's address toward HOST
    if len(sys.argv) != 2:
        sys.exit("usage: python -m pace.net HOST   (this host's address on the route to HOST)")
    print(source_address(sys.argv[1]))

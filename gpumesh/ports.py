"""Ports for child processes that a launcher starts on loopback (benchmarks, tests, the demo).

A launcher that picks a port and passes it to a child (``--port N``) races everything that
binds until the child does. ``bind(("", 0))`` is the worst choice for that: the kernel hands
out the same ephemeral range to every other ``bind(0)`` and outgoing connection, including
the control ports a multi-worker router picks for itself, and it can hand the same port to
two consecutive calls once the first probe socket is closed. Two gRPC servers sharing a port
with SO_REUSEPORT then split each other's connections: a node answers the router's
``GetFleet`` with UNIMPLEMENTED and the launcher waits forever.

``free_port`` therefore picks ports *below* the kernel's ephemeral range (which nothing binds
by accident), never hands out the same port twice in one process, and checks that the port
binds right now. Processes that pick their own ports keep using ``bind(0)``.
"""

from __future__ import annotations

import os
import random
import socket
import threading

_LOW = 20000
_lock = threading.Lock()
_given: set[int] = set()
_rng = random.Random(os.getpid() ^ int.from_bytes(os.urandom(4), "little"))


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # the Linux default


def _binds(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1") -> int:
    """A port on ``host`` that binds now, outside the ephemeral range, new to this process."""
    high = _ephemeral_low() - 1
    with _lock:
        if high - _LOW < 1000:  # an unusual port range: fall back to the kernel's choice
            for _ in range(100):
                with socket.socket() as s:
                    s.bind((host, 0))
                    port = int(s.getsockname()[1])
                if port not in _given:
                    _given.add(port)
                    return port
            raise RuntimeError("no free port")
        for _ in range(2000):
            port = _rng.randint(_LOW, high)
            if port not in _given and _binds(host, port):
                _given.add(port)
                return port
    raise RuntimeError(f"no free port in {_LOW}-{high} on {host}")

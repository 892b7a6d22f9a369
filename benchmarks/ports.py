"""Local TCP ports for the servers the benchmarks and tests start.

A port is taken from 20000-32767: below Linux's default ephemeral range (32768-60999), where
the OS hands out the ports of outgoing connections and of every `bind(0)` (Ray's own servers
among them), and above Ray's worker port range (10002-19999). A port found free there cannot be
taken by a process that merely asked the OS for any port in the seconds before the server
binds it, which is what made probing with `bind(0)` race against Ray's start-up.
"""

from __future__ import annotations

import random
import socket

LOW, HIGH = 20000, 32767


def free_port() -> int:
    """A port on 127.0.0.1 that nothing listens on now (tried at random in LOW..HIGH)."""
    chooser = random.SystemRandom()
    for _ in range(200):
        port = chooser.randint(LOW, HIGH)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {LOW}-{HIGH} after 200 tries")

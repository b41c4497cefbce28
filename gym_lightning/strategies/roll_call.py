"""The roll call's transport: every rank's answering thread (:class:`Responder`, plain TCP) and the pings and
verdicts other ranks send it (``strategies.rank_failure`` decides what they mean)."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

PING_SECONDS = 30.0  # longest wait for a rank's answer to a roll call (a third of the collective timeout if less)


class Responder:
    """A rank's answering thread: answers a roll call's ping at once, whatever the main thread is doing (a slow
    rank is never named: only a stopped or dead process stays silent), and hands a verdict another rank sends to
    ``on_verdict``. Plain TCP rather than a process group: nothing to build collectively, a timeout on every
    wait, nothing shared with the main thread's collectives, and a stopped process's kernel still accepts the
    connection (the ping then times out) while a dead one's refuses it (at once). Its ``address``
    (``host:port/token``) carries a random token every message must repeat: a verdict makes a rank exit, and only
    the job's ranks (which gathered the addresses) may send one."""

    def __init__(self, on_verdict: Callable[[dict[str, Any]], None]) -> None:
        self.on_verdict = on_verdict
        self.server = socket.create_server(("", 0), backlog=64)
        self.token = secrets.token_hex(16).encode()
        self.address = f"{_reachable_ip()}:{self.server.getsockname()[1]}/{self.token.decode()}"
        self.thread = threading.Thread(target=self._serve, name="gym-rank-responder", daemon=True)
        self.thread.start()

    def close(self) -> None:
        with contextlib.suppress(OSError):  # shutdown wakes the thread's accept() (close alone does not, on Linux)
            self.server.shutdown(socket.SHUT_RDWR)
        self.server.close()

    def _serve(self) -> None:
        while True:
            try:
                connection, _ = self.server.accept()
            except OSError:  # closed
                return
            try:
                with connection:
                    connection.settimeout(PING_SECONDS)
                    kind, token, body = [*connection.makefile("rb").readline().strip().split(b" ", 2), b"", b""][:3]
                    if token != self.token:
                        continue
                    if kind != b"V":
                        connection.sendall(b"here\n")
                        continue
                verdict = json.loads(body)
            except (OSError, ValueError):
                continue
            self.on_verdict(verdict)


def roll_call(addresses: list[str], me: int, wait: float) -> list[bool]:
    """Which ranks' responders (at ``addresses``, ``host:port``) answered a ping within ``wait`` seconds, all
    pinged at once; rank ``me`` (the caller) counts as arrived."""
    others = [rank for rank in range(len(addresses)) if rank != me]
    answered = for_each([addresses[rank] for rank in others], lambda address: _ping(address, wait))
    answers = dict(zip(others, answered, strict=True))
    return [rank == me or answers[rank] for rank in range(len(addresses))]


def send_verdict(address: str, verdict: dict[str, Any]) -> None:
    """Tell the rank at ``address`` what the roll call found (it acts on it and exits); never raises."""
    host, port, token = _parse(address)
    try:
        with socket.create_connection((host, port), timeout=5.0) as connection:
            connection.sendall(b"V " + token + b" " + json.dumps(verdict).encode() + b"\n")
    except OSError:
        pass


def _ping(address: str, wait: float) -> bool:
    deadline = time.monotonic() + wait
    host, port, token = _parse(address)
    try:
        with socket.create_connection((host, port), timeout=wait) as connection:
            connection.settimeout(max(0.01, deadline - time.monotonic()))
            connection.sendall(b"P " + token + b"\n")
            return connection.makefile("rb").readline().startswith(b"here")
    except OSError:
        return False


def _parse(address: str) -> tuple[str, int, bytes]:
    """``host:port/token`` (a ``Responder.address``) as (host, port, token)."""
    place, _, token = address.partition("/")
    host, port = place.rsplit(":", 1)
    return host, int(port), token.encode()


def for_each(items: list[Any], call: Callable[[Any], Any]) -> list[Any]:
    """``call`` on every item at once (threads): a roll call waits for its slowest answer, not for their sum."""
    if not items:
        return []
    with ThreadPoolExecutor(max_workers=min(len(items), 256), thread_name_prefix="gym-roll-call") as pool:
        return list(pool.map(call, items))


def _reachable_ip() -> str:
    """This host's address on its route to the job's master (``MASTER_ADDR``, set by Lightning's launcher and
    torchrun): the address the other hosts reach this one by. UDP ``connect`` sends nothing, it picks the route."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((os.environ.get("MASTER_ADDR", "127.0.0.1"), 9))
            return probe.getsockname()[0]
        except OSError:
            return "127.0.0.1"


__all__ = ["PING_SECONDS", "Responder", "for_each", "roll_call", "send_verdict"]

"""Loopback/host port helpers for the servers vime starts (engines, router)."""

from __future__ import annotations

import socket

from vime.errors import UserError


class PortInUseError(UserError, RuntimeError):
    """A server was asked to start on a port that something else already holds."""

    def __init__(self, host: str, port: int, what: str = "server"):
        self.host = host
        self.port = port
        self.what = what
        super().__init__(f"cannot start {what}: port {port} on {host} is already in use")

    def __reduce__(self):  # errors cross Ray actor boundaries: keep them picklable
        return type(self), (self.host, self.port, self.what)


def free_port(host: str = "127.0.0.1") -> int:
    """A port the OS reports free right now.

    The port is released before returning, so another process can take it before the caller binds
    it; servers started on it must fail loudly (they do: the bind error ends up in their log).
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def port_is_free(host: str, port: int) -> bool:
    """Whether a server could bind ``host:port`` now.

    SO_REUSEADDR mirrors what uvicorn (vLLM) and tokio (vllm-router) set: a port in TIME_WAIT counts
    as free because those servers can bind it, while a port with a live listener does not.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
        return True

"""A TCP relay between two processes that a test can cut and restore: the network blip of a
gateway <-> worker connection (a restarted proxy, a flapping link) without touching either process.

``Relay(target)`` listens on a free loopback port and pipes each accepted connection to
``target`` ("host:port"), one thread per direction. ``cut()`` closes the listener and every piped
connection (both ends see a reset / EOF); ``restore()`` listens again on the same port.
"""
from __future__ import annotations

import socket
import threading

from server.launch.local import free_port


class Relay:
    def __init__(self, target: str, port: int | None = None):
        host, _, p = target.rpartition(":")
        self.target = (host, int(p))
        self.port = port or free_port()
        self.addr = f"127.0.0.1:{self.port}"
        self._lock = threading.Lock()
        self._conns: list[socket.socket] = []
        self._listener: socket.socket | None = None
        self.accepted = 0
        self.restore()

    def restore(self) -> None:
        """Listen (again) on ``self.port`` and pipe new connections to the target."""
        srv = socket.socket()
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        srv.bind(("127.0.0.1", self.port))
        srv.listen(64)
        self._listener = srv
        threading.Thread(target=self._accept, args=(srv,), daemon=True).start()

    def cut(self) -> None:
        """Close the listener and every piped connection (with RST: SO_LINGER 0)."""
        with self._lock:
            srv, self._listener = self._listener, None
            conns, self._conns = self._conns, []
        if srv is not None:
            srv.close()
        for c in conns:
            try:
                c.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
                c.close()
            except OSError:
                pass

    def close(self) -> None:
        self.cut()

    def _accept(self, srv: socket.socket) -> None:
        while True:
            try:
                a, _ = srv.accept()
            except OSError:
                return                       # cut
            try:
                b = socket.create_connection(self.target, timeout=5)
            except OSError:
                a.close()
                continue
            b.settimeout(None)
            with self._lock:
                if self._listener is not srv:        # cut while connecting
                    a.close()
                    b.close()
                    return
                self._conns += [a, b]
                self.accepted += 1
            for src, dst in ((a, b), (b, a)):
                threading.Thread(target=self._pipe, args=(src, dst), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(1 << 16):
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

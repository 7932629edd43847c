"""A byte relay between two processes' ZMQ endpoints that a test can reset: ``reset()`` aborts
every relayed connection (an RST on tcp, like ``ss -K`` on the port) and restarts the listener
(after ``down_s``: a blip), so libzmq on both sides sees the connection die while both processes
stay alive. Used between prefill and decode (the state connection) and gateway and workers.

Addresses are ZMQ endpoints: ``tcp://127.0.0.1:PORT`` or ``ipc:///PATH``. One selector thread
moves the bytes (blocking ``sendall`` with a timeout: the test peers always read).
"""
from __future__ import annotations

import os
import selectors
import socket
import struct
import threading
import time


def _sock_for(endpoint: str) -> tuple[socket.socket, object]:
    if endpoint.startswith("tcp://"):
        host, port = endpoint[6:].rsplit(":", 1)
        return socket.socket(socket.AF_INET, socket.SOCK_STREAM), (host.strip("[]"), int(port))
    if endpoint.startswith("ipc://"):
        return socket.socket(socket.AF_UNIX, socket.SOCK_STREAM), endpoint[6:]
    raise ValueError(f"relay endpoint {endpoint!r}: tcp:// or ipc:// only")


def _abort(s: socket.socket) -> None:
    """Close with an RST where the family has one (SO_LINGER 0), never a graceful FIN."""
    try:
        if s.family == socket.AF_INET:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        s.close()
    except OSError:
        pass


class Relay:
    """Relays ``listen`` -> ``upstream`` (both ZMQ endpoints). ``resets``: how many resets were
    done; ``killed``: connections aborted by them in all."""

    def __init__(self, upstream: str, listen: str):
        self.upstream, self.address = upstream, listen
        self.resets = self.killed = 0
        self._sel = selectors.DefaultSelector()
        self._peer: dict[socket.socket, socket.socket] = {}
        self._lock = threading.Lock()
        self._req = threading.Event()
        self._done = threading.Event()
        self._stop = False
        self._down_s = 0.0
        self._wake_r, self._wake_w = socket.socketpair()
        self._sel.register(self._wake_r, selectors.EVENT_READ)
        self._listen()
        self._thread = threading.Thread(target=self._run, name="test-relay", daemon=True)
        self._thread.start()

    def _listen(self) -> None:
        s, addr = _sock_for(self.address)
        if s.family == socket.AF_UNIX and os.path.exists(addr):
            os.unlink(addr)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(addr)
        s.listen(16)
        self._lsock = s
        self._sel.register(s, selectors.EVENT_READ)

    def reset(self, timeout_s: float = 5.0, down_s: float = 0.0) -> int:
        """Abort every relayed connection and restart the listener (same address) ``down_s``
        seconds later (nothing connects meanwhile). Returns how many connections were aborted.
        Raises TimeoutError if the relay thread does not answer."""
        before = self.killed
        self._down_s = down_s
        self._done.clear()
        self._req.set()
        self._wake_w.send(b"r")
        if not self._done.wait(timeout_s):
            raise TimeoutError("relay did not reset")
        return self.killed - before

    def close(self) -> None:
        self._stop = True
        self._wake_w.send(b"x")
        self._thread.join(5)
        for s in list(self._peer):
            _abort(s)
        self._lsock.close()
        self._wake_r.close()
        self._wake_w.close()
        if self.address.startswith("ipc://") and os.path.exists(self.address[6:]):
            os.unlink(self.address[6:])

    # -- the relay thread ----------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop:
            for key, _ in self._sel.select(0.5):
                s = key.fileobj
                if s is self._wake_r:
                    self._wake_r.recv(64)
                elif s is self._lsock:
                    self._accept()
                elif s in self._peer:
                    self._pump(s)
            if self._req.is_set():
                self._req.clear()
                self._do_reset()
                self._done.set()

    def _accept(self) -> None:
        try:
            down, _ = self._lsock.accept()
        except OSError:
            return
        up, addr = _sock_for(self.upstream)
        try:
            up.settimeout(5)
            up.connect(addr)
        except OSError:        # receiver not there (restarting): the sender reconnects later
            _abort(down)
            up.close()
            return
        for a, b in ((down, up), (up, down)):
            a.settimeout(10)
            self._peer[a] = b
            self._sel.register(a, selectors.EVENT_READ)

    def _pump(self, s: socket.socket) -> None:
        other = self._peer[s]
        try:
            data = s.recv(1 << 16)
            if data:
                other.sendall(data)
                return
        except OSError:
            pass
        self._drop(s, other)

    def _drop(self, *socks) -> None:
        for s in socks:
            if self._peer.pop(s, None) is not None:
                self._sel.unregister(s)
            _abort(s)

    def _do_reset(self) -> None:
        socks = list(self._peer)
        self.killed += len(socks) // 2
        self.resets += 1
        self._drop(*socks)
        self._sel.unregister(self._lsock)
        self._lsock.close()
        time.sleep(self._down_s)
        self._listen()

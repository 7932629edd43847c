"""Cluster shared secret -> ZMQ CURVE keys, ZAP authentication, and a rate-limited logger.

Every process of one P/D cluster is given the same secret string (>= 16 characters). From it each
derives, deterministically and offline, two CURVE keypairs:

    server keypair   held by every socket that binds (decode state receiver ROUTER, worker ROUTER)
    client keypair   held by every socket that connects (prefill state sender DEALER, gateway DEALER)

CURVE (CurveZMQ, ZMQ RFC 26) then gives each connection encryption and mutual authentication:
the client proves it knows the server's public key (the server cannot decrypt a HELLO made for
another key), the server proves it holds the matching secret key, and the server hands the
client's long-term public key to a ZAP handler (ZMQ RFC 27) that accepts only the derived client
key. A peer without the secret never completes the handshake, so not one of its frames reaches
the application: garbage, fuzzed frames and oversize messages from such a peer die inside libzmq.

With no secret (``None``) every function here is a no-op: plain TCP / IPC (NULL mechanism), as
before -- then bind to loopback or a trusted network only.

Lifetime of the ZAP handler: one ``zmq.auth.thread.ThreadAuthenticator`` per ``zmq.Context``
(libzmq routes ZAP requests to ``inproc://zeromq.zap.01`` of the socket's own context), started by
``ensure_authenticator`` (``secure_server`` calls it). It owns two sockets and a thread in that
context, so the context's owner MUST call ``stop_authenticator(ctx)`` before ``ctx.term()``
(``term`` otherwise blocks forever on the handler's open sockets). Works for ``zmq.Context`` and
``zmq.asyncio.Context`` alike (the handler uses its own plain sockets on its own thread).
"""
from __future__ import annotations

import hashlib
import hmac
import logging
import threading
import time
import weakref
from dataclasses import dataclass, field

import zmq
from zmq.utils import z85

MIN_SECRET_CHARS = 16
ZAP_DOMAIN = "dsv4-pd"
_SALT = b"dsv4-pd cluster secret v1"
_LABEL_SERVER = b"dsv4-pd/zmq-curve/server-key"
_LABEL_CLIENT = b"dsv4-pd/zmq-curve/client-key"

log = logging.getLogger(__name__)


def _hkdf_sha256(ikm: bytes, info: bytes) -> bytes:
    """32 bytes of HKDF-SHA256 (RFC 5869, one output block) keyed by ``ikm``, labelled ``info``."""
    prk = hmac.new(_SALT, ikm, hashlib.sha256).digest()
    return hmac.new(prk, info + b"\x01", hashlib.sha256).digest()


def _keypair(ikm: bytes, label: bytes) -> tuple[bytes, bytes]:
    secret = z85.encode(_hkdf_sha256(ikm, label))   # any 32 bytes are a curve25519 secret (clamped)
    return zmq.curve_public(secret), secret


@dataclass(frozen=True)
class ClusterKeys:
    """The cluster's two CURVE keypairs, z85-encoded (40 bytes each). ``repr`` hides the secrets."""
    server_public: bytes
    server_secret: bytes = field(repr=False)
    client_public: bytes
    client_secret: bytes = field(repr=False)

    @classmethod
    def from_secret(cls, secret: str | bytes) -> ClusterKeys:
        """Derive both keypairs from the shared secret (HKDF-SHA256, distinct labels). Deterministic:
        every process given the same secret gets the same keys. The exact bytes matter (a trailing
        newline makes another secret).

        Raises:
            TypeError: ``secret`` is not str / bytes.
            ValueError: ``secret`` is empty or shorter than 16 characters (16 bytes for bytes).
        """
        if isinstance(secret, str):
            raw = secret.encode("utf-8")
        elif isinstance(secret, (bytes, bytearray)):
            raw = bytes(secret)
        else:
            raise TypeError(f"cluster secret must be str or bytes, found {type(secret).__name__}")
        if not secret:
            raise ValueError("cluster secret is empty: give at least 16 characters, or no secret at all (None)")
        if len(secret) < MIN_SECRET_CHARS:
            raise ValueError(f"cluster secret is too short: {len(secret)} characters, at least "
                             f"{MIN_SECRET_CHARS} required")
        if not zmq.has("curve"):   # pragma: no cover - pyzmq wheels ship libzmq with CURVE
            raise RuntimeError("this libzmq has no CURVE support: a cluster secret cannot be used")
        spub, ssec = _keypair(raw, _LABEL_SERVER)
        cpub, csec = _keypair(raw, _LABEL_CLIENT)
        return cls(spub, ssec, cpub, csec)


def cluster_keys(secret: str | bytes | ClusterKeys | None) -> ClusterKeys | None:
    """Normalise what callers pass as ``secret``: None -> None (no security), ClusterKeys as is,
    str / bytes -> ``ClusterKeys.from_secret`` (raises its ValueError / TypeError)."""
    if secret is None or isinstance(secret, ClusterKeys):
        return secret
    return ClusterKeys.from_secret(secret)


def secure_server(sock: zmq.Socket, secret: str | bytes | ClusterKeys | None, domain: str = ZAP_DOMAIN) -> None:
    """Make a socket that binds a CURVE server (call BEFORE ``bind``): server secret key, ZAP
    domain, and the context's ZAP handler (``ensure_authenticator``) accepting only the cluster's
    client key. No-op for ``secret`` None.

    The context's owner must call ``stop_authenticator(ctx)`` before ``ctx.term()``.

    Raises:
        ValueError / TypeError: a bad secret (see ``ClusterKeys.from_secret``), or this context's
            handler was started for other keys. zmq.ZMQError: the socket rejects the options.
    """
    keys = cluster_keys(secret)
    if keys is None:
        return
    ensure_authenticator(sock.context, keys, domain)
    sock.setsockopt(zmq.CURVE_SERVER, 1)
    sock.setsockopt(zmq.CURVE_SECRETKEY, keys.server_secret)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.server_public)
    sock.setsockopt(zmq.ZAP_DOMAIN, domain.encode())


def secure_client(sock: zmq.Socket, secret: str | bytes | ClusterKeys | None) -> None:
    """Make a socket that connects a CURVE client of the cluster (call BEFORE ``connect``): the
    client keypair plus the server's public key. No authenticator is needed on the client side
    (the client authenticates the server by its key). No-op for ``secret`` None.

    Raises:
        ValueError / TypeError: a bad secret. zmq.ZMQError: the socket rejects the options.
    """
    keys = cluster_keys(secret)
    if keys is None:
        return
    sock.setsockopt(zmq.CURVE_SECRETKEY, keys.client_secret)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.client_public)
    sock.setsockopt(zmq.CURVE_SERVERKEY, keys.server_public)


class _OnlyClusterClient:
    """ZAP curve callback: accept only the cluster's client public key (constant-time compare)."""

    def __init__(self, keys: ClusterKeys):
        self._key = keys.client_public
        self._rlog = RateLimitedLog(log)

    def callback(self, domain: str, key: bytes) -> bool:
        ok = hmac.compare_digest(bytes(key), self._key)
        if not ok:
            self._rlog.warning("zap-denied", "ZAP: refused a CURVE peer whose key is not the cluster's "
                               "(domain %s; its cluster secret differs)", domain)
        return ok


_auth_lock = threading.Lock()
_auths: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()   # ctx -> (authenticator, keys, domain)


def ensure_authenticator(ctx: zmq.Context, secret: str | bytes | ClusterKeys | None, domain: str = ZAP_DOMAIN):
    """Start (once per context) the ZAP handler that accepts only the cluster's client key on
    ``domain``. Idempotent and thread-safe; returns the ``ThreadAuthenticator`` (None for no
    secret). Works for ``zmq.asyncio.Context`` too.

    Lifetime: the handler runs until ``stop_authenticator(ctx)``, which the context's owner must
    call before ``ctx.term()``.

    Raises:
        ValueError: this context already has a handler for other keys or another domain.
        RuntimeError: the handler thread did not start. zmq.ZMQError: another ZAP handler is
            already bound in this context (``inproc://zeromq.zap.01``).
    """
    keys = cluster_keys(secret)
    if keys is None:
        return None
    from zmq.auth.thread import ThreadAuthenticator
    with _auth_lock:
        have = _auths.get(ctx)
        if have is not None:
            auth, hkeys, hdomain = have
            if hkeys != keys or hdomain != domain:
                raise ValueError("this zmq.Context already authenticates another cluster key / ZAP domain")
            return auth
        auth = ThreadAuthenticator(ctx, log=logging.getLogger("zmq.auth"))
        auth.start()
        try:
            auth.configure_curve_callback(domain, credentials_provider=_OnlyClusterClient(keys))
        except BaseException:
            auth.stop()
            raise
        _auths[ctx] = (auth, keys, domain)
        return auth


def stop_authenticator(ctx: zmq.Context) -> bool:
    """Stop ``ctx``'s ZAP handler (joins its thread, closes its sockets). Call before
    ``ctx.term()``. Idempotent; True when one was running. After this, CURVE handshakes on the
    context's server sockets are no longer checked against the client key: close those first."""
    with _auth_lock:
        have = _auths.pop(ctx, None)
    if have is None:
        return False
    have[0].stop()
    return True


# --------------------------------------------------------------------------------------------- #

class RateLimitedLog:
    """At most one log line per *cause* per ``interval_s``; the next line emitted for that cause
    says how many were suppressed meanwhile. So a peer sending garbage cannot flood the log.

    Causes should be a small fixed set of strings (never peer-controlled text); at most
    ``max_causes`` are remembered (oldest forgotten first), so memory stays bounded regardless.
    Thread-safe.
    """

    def __init__(self, logger: logging.Logger, interval_s: float = 10.0, max_causes: int = 256, clock=time.monotonic):
        self.logger, self.interval_s, self.max_causes, self._clock = logger, interval_s, max_causes, clock
        self._lock = threading.Lock()
        self._state: dict[str, list] = {}   # cause -> [time of the last emitted line, suppressed since]

    def log(self, level: int, cause: str, msg: str, *args) -> bool:
        """Log ``msg % args`` at ``level`` unless ``cause`` logged within ``interval_s``. True if emitted."""
        now = self._clock()
        with self._lock:
            st = self._state.get(cause)
            if st is not None and now - st[0] < self.interval_s:
                st[1] += 1
                return False
            suppressed = st[1] if st is not None else 0
            self._state.pop(cause, None)
            self._state[cause] = [now, 0]
            while len(self._state) > self.max_causes:
                del self._state[next(iter(self._state))]
        if suppressed:
            msg, args = msg + " (%d more like this suppressed since the last one)", (*args, suppressed)
        self.logger.log(level, msg, *args)
        return True

    def warning(self, cause: str, msg: str, *args) -> bool:
        return self.log(logging.WARNING, cause, msg, *args)

    def info(self, cause: str, msg: str, *args) -> bool:
        return self.log(logging.INFO, cause, msg, *args)

"""TLS for the broker's listeners: the contexts from a listener's files, the handshake run as
a half-open socket (bounded by the CONNECT deadline, counted in :class:`Admission`), the
contexts replaced on reload (SIGHUP) for new connections, and the peer certificate's name.

Part of the asyncio shell (:mod:`filemq.broker.server` wires it): the MQTT session and the
core never see TLS, only the bytes it decrypted.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from typing import cast

from filemq.broker.admission import Admission
from filemq.broker.session.connection import AWAITING_CONNECT
from filemq.common.config import Listener

log = logging.getLogger("filemq.broker")


class _Handshaking:
    """A TLS socket in its handshake, counted in :class:`Admission` like a socket that has
    not sent its CONNECT yet: silent, it may give way at ``max_connecting``, so sockets that
    never finish a handshake cannot pile up until the deadline."""

    __slots__ = ("raw", "closed", "last_rx", "connected_at")
    state = AWAITING_CONNECT

    def __init__(self, raw: asyncio.Transport, accepted_at: float) -> None:
        self.raw = raw
        self.closed = False
        self.last_rx = self.connected_at = accepted_at

    def close(self, reason: str, will: bool = False, level: int = logging.INFO) -> None:
        if not self.closed:
            self.closed = True
            log.log(level, "closing a TLS handshake from %s: %s", self.raw.get_extra_info("peername"), reason)
            self.raw.abort()


class TlsGate(asyncio.Protocol):
    """Accepts a TCP socket for a TLS listener and runs the handshake itself (``start_tls``),
    so that the handshake counts as half-open (:class:`_Handshaking`) and is bounded by the
    CONNECT deadline; then hands the TLS transport to ``inner`` (the MQTT or WebSocket
    protocol), as ``create_server(ssl=...)`` would. It stays the TLS transport's protocol and
    passes everything on: what arrives between the handshake's end and ``inner``'s
    ``connection_made`` (a client sends its CONNECT at once) is held and passed on then."""

    __slots__ = ("inner", "ctx", "half_open", "timeout", "pending", "held", "ready", "task", "accepted_at")

    def __init__(self, inner: asyncio.Protocol, ctx: ssl.SSLContext, half_open: Admission,
                 timeout: float, accepted_at: float) -> None:
        self.inner = inner
        self.accepted_at = accepted_at
        self.ctx = ctx
        self.half_open = half_open
        self.timeout = timeout
        self.pending: _Handshaking | None = None
        self.held: list[bytes] = []
        self.ready = False
        self.task: asyncio.Task[None] | None = None  # referenced: the loop only holds tasks weakly

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport = cast(asyncio.Transport, transport)  # (uvloop transports do not subclass it)
        transport.pause_reading()  # the ClientHello is for the TLS layer start_tls puts in
        self.pending = _Handshaking(transport, self.accepted_at)
        self.half_open.admit(self.pending, transport.get_extra_info("socket"))
        self.task = asyncio.get_running_loop().create_task(self._handshake(transport, self.pending))

    async def _handshake(self, raw: asyncio.Transport, pending: _Handshaking) -> None:
        loop = asyncio.get_running_loop()
        try:
            tls = await loop.start_tls(raw, self, self.ctx, server_side=True, ssl_handshake_timeout=self.timeout)
        except Exception as exc:  # noqa: BLE001 - a failed handshake of any kind closes the socket
            if not pending.closed:
                log.info("TLS handshake from %s failed: %s", raw.get_extra_info("peername"), exc)
            pending.closed = True
            raw.abort()
            return
        if pending.closed or tls is None:  # given way to newer sockets meanwhile
            if tls is not None:
                tls.abort()
            return
        pending.closed = True  # leaves HalfOpen; the MQTT connection is admitted in its place
        self.ready = True
        self.inner.connection_made(tls)
        held, self.held = self.held, []
        for data in held:
            self.inner.data_received(data)

    def data_received(self, data: bytes) -> None:
        if self.ready:
            self.inner.data_received(data)
        else:
            self.held.append(data)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received() if self.ready else None

    def connection_lost(self, exc: Exception | None) -> None:
        if self.pending is not None:
            self.pending.closed = True
        if self.ready:
            self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        if self.ready:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        if self.ready:
            self.inner.resume_writing()


def certificate_cn(cert: object) -> str | None:
    """The commonName of a peer certificate as ``SSLObject.getpeercert()`` returns it."""
    if not isinstance(cert, dict):
        return None
    for rdn in cert.get("subject", ()):
        for key, value in rdn:
            if key == "commonName" and isinstance(value, str) and value:
                return value
    return None


def tls_context(listener: Listener) -> ssl.SSLContext:
    """A server context from the listener's files; raises OSError / ssl.SSLError.

    Built from ``PROTOCOL_TLS_SERVER``, not ``create_default_context``: the latter trusts the
    system's CAs for client certificates, and any public certificate with a CN would then
    log in under that name with ``use_identity_as_username``.  Only ``tls_ca`` is trusted.
    """
    assert listener.tls_cert is not None
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(listener.tls_cert, listener.tls_key)
    if listener.tls_ca is not None:
        ctx.load_verify_locations(listener.tls_ca)
        ctx.verify_mode = ssl.CERT_REQUIRED if listener.require_certificate else ssl.CERT_OPTIONAL
    if listener.tls_crl is not None:
        # Every handshake checks the client certificate against this CRL (a revoked or a CRL
        # missing for its CA fails it); SIGHUP re-reads it with the other files (reload_tls).
        ctx.load_verify_locations(listener.tls_crl)
        ctx.verify_flags |= ssl.VERIFY_CRL_CHECK_LEAF
    return ctx


class TlsListener:
    """A TLS listener's context, replaceable while it listens (:meth:`Broker.reload_tls`).

    asyncio binds one SSLContext to a server for its lifetime; that first context's SNI
    callback -- called for every handshake, with or without a server name -- hands each new
    connection the current context, so reloaded certificates serve new connections and
    established ones keep theirs.
    """

    def __init__(self, listener: Listener, ctx: ssl.SSLContext) -> None:
        self.listener = listener
        self.base = ctx
        self.current = ctx
        ctx.sni_callback = self._pick

    def _pick(self, sslobj: ssl.SSLObject, name: str | None, ctx: ssl.SSLContext) -> None:
        current = self.current
        if current is not ctx:
            sslobj.context = current

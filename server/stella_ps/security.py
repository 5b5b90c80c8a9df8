"""Who may talk to the server: CurveZMQ keys, the allowlist of client keys, and the
ZAP handler that admits only those.

The server authenticates with its key pair (a ZeroMQ certificate file holding the
secret key, as ``stella keygen`` writes it); every client proves it holds the secret
of a public key on the allowlist before the first byte of a message reaches the
server, and everything on the wire is encrypted. The allowlist is a text file, one
Z85 public key per line, as ``stella keygen`` prints it (anything after the key is a
comment, and so is a line starting with ``#`` that is not a key; the comment is the
key's name in ``status``). It is read again when the file at its path changes (its
inode, size or modification time, looked at, at most once a second, when a peer
connects or sends) and on SIGHUP, without a restart: an edit in place and a
replacement (``sed -i``, most editors, configuration tools) alike. In a container,
mount the allowlist's *directory*: a single-file bind mount pins the inode it was
started with, and a replaced file is never seen there. A key removed from it can no
longer connect, and the messages of its open connections are refused from then on
(the server drops its workers). An empty allowlist admits nobody (a warning says so).

Every connection refused at the handshake is counted by reason (:data:`REFUSED`:
a key not on the allowlist, a banned key, or a handshake that failed before any key
was shown, such as a client holding the wrong server key or none), for the
``stella_refused_connections_total`` metric.

A peer is known in logs and ``status`` by the fingerprint of its public key, never by
the key itself.

A key can be *banned* for a while (:meth:`Allowlist.ban`): the server does so after an
oversized message, and :class:`Connections` then cuts the TCP connections of the host
it came from (libzmq bounds each frame, not a multipart message: it buffers the whole
message before the server sees it, so the least the server can do is hang up and not
let the same key straight back in).
"""
from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import zmq
import zmq.asyncio
import zmq.auth
from zmq.utils import z85
from zmq.utils.monitor import parse_monitor_message

from stella.errors import IMAGE_UID, unreadable
from stella.protocol import key_fingerprint

from .errors import ConfigError

__all__ = ["ServerKeys", "Allowlist", "Gatekeeper", "Connections", "KeySet", "write_keyset", "fingerprint",
           "ZAP_DOMAIN", "REFUSED", "IMAGE_UID", "load_server_keys", "unreadable"]

log = logging.getLogger("stella_ps.security")
ZAP_DOMAIN = "stella"
RELOAD_CHECK_S = 1.0  # how often the allowlist file is looked at for a change
# why a connection was refused at the handshake (the metric's `reason` label)
REFUSED = ("not_allowed", "banned", "handshake")


fingerprint = key_fingerprint  # a short, stable name for a public key (16 hex digits of its SHA-256)


@dataclass(frozen=True)
class ServerKeys:
    public: bytes  # Z85
    secret: bytes  # Z85


def load_server_keys(path: str) -> ServerKeys:
    """The server's key pair from a ZeroMQ certificate file with its secret key."""
    folder = os.path.dirname(path) or "."
    if not os.path.exists(path) and os.path.isdir(folder) and not os.listdir(folder):
        # what a container sees when the host's keys directory is missing: Docker bind-mounts an empty one it made
        raise ConfigError(f"{path!r} does not exist and its directory is empty: in a container, the host's keys "
                          "directory (STELLA_KEYS_DIR, ./keys by default) was probably missing, and Docker mounted "
                          "an empty one it created; make the keys there first (`stella keygen`, docker/README.md) "
                          "and start the server again")
    try:
        public, secret = zmq.auth.load_certificate(path)
    except OSError as e:
        raise ConfigError(f"cannot read the server's key pair from {path!r}: {unreadable(path, e)}") from None
    except ValueError as e:
        raise ConfigError(f"cannot read the server's key pair from {path!r}: {e}") from None
    if not secret:
        raise ConfigError(f"{path!r} holds no secret key: give the server the '.key_secret' file "
                          "that `stella keygen` wrote")
    return ServerKeys(public, secret)


@dataclass(frozen=True)
class KeySet:
    """Paths of a job's key files: the server's pair, the clients' pairs, the allowlist."""

    server_public: str  # what clients are given (STELLA_SERVER_KEY)
    server_secret: str  # stella-ps --keys
    allowlist: str  # stella-ps --allow
    client_secrets: dict[str, str]  # name -> the client's .key_secret (STELLA_CLIENT_KEY)


def write_keyset(directory: str, clients: tuple[str, ...] = ("client",)) -> KeySet:
    """Make a server key pair, one pair per client name, and an allowlist admitting
    those clients, in ``directory`` (the secret files readable by the owner only)."""
    os.makedirs(directory, exist_ok=True)
    server_public, server_secret = zmq.auth.create_certificates(directory, "server")
    secrets, lines = {}, []
    for name in clients:
        public, secret = zmq.auth.create_certificates(directory, name)
        secrets[name] = secret
        lines.append(f"{zmq.auth.load_certificate(public)[0].decode()} {name}")
    for path in (server_secret, *secrets.values()):
        os.chmod(path, 0o600)
    allowlist = os.path.join(directory, "allowlist")
    with open(allowlist, "w") as f:
        f.write("\n".join(lines) + "\n")
    return KeySet(server_public, server_secret, allowlist, secrets)


def _parse_key(text: str) -> str | None:
    try:
        raw = z85.decode(text.encode())
    except (ValueError, TypeError, KeyError):
        return None
    return text if len(raw) == 32 else None


def _signature(st: os.stat_result) -> tuple[int, int, int, int]:
    """What tells a changed allowlist file: a replacement has a new inode (and perhaps
    the old modification time, ``cp -p``), an edit in place a new time or size."""
    return st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size


class Allowlist:
    """The client public keys the server admits, from a text file, reloaded on change."""

    def __init__(self, path: str):
        self.path = path
        self._keys: dict[str, str] = {}  # Z85 key -> its comment (a name), if any
        self._banned: dict[str, float] = {}  # Z85 key -> monotonic time its ban ends
        self._seen: tuple[int, int, int, int] | None = None  # the file's _signature when last read
        self._checked = 0.0
        self.reload(strict=True)

    def __len__(self) -> int:
        return len(self._keys)

    def reload(self, *, strict: bool = False) -> bool:
        """Read the file again; returns whether the set of keys changed. A file that
        cannot be read or holds a malformed line raises at start-up (``strict``) and
        keeps the previous list afterwards (logged as an error)."""
        try:
            with open(self.path) as f:
                seen = _signature(os.fstat(f.fileno()))
                lines = f.read().splitlines()
            keys: dict[str, str] = {}
            for n, line in enumerate(lines, 1):
                line = line.strip()
                word, _, comment = line.partition(" ")
                key = _parse_key(word)  # before the comment test: '#' is a Z85 digit
                if key is None:
                    if not line or line.startswith("#"):
                        continue
                    raise ConfigError(f"{self.path}:{n}: not a Z85 public key (40 characters): {word[:48]!r}")
                keys[key] = comment.strip()
        except OSError as e:
            reason = unreadable(self.path, e)
            if strict:
                raise ConfigError(f"allowlist {self.path!r}: {reason}") from None
            log.error("allowlist not reloaded; the previous one stays in force",
                      extra={"path": self.path, "reason": reason})
            return False
        except ConfigError as e:
            if strict:
                raise ConfigError(f"allowlist {self.path!r}: {e}") from None
            log.error("allowlist not reloaded; the previous one stays in force",
                      extra={"path": self.path, "reason": str(e)})
            return False
        changed = keys != self._keys
        self._keys, self._seen = keys, seen
        if changed and not strict:
            log.warning("allowlist reloaded", extra={"path": self.path, "keys": len(keys)})
        if not keys and (changed or strict):
            log.warning("the allowlist is empty: no client can connect until a key is added (the file is read "
                        "again when it changes)", extra={"path": self.path})
        return changed

    def maybe_reload(self) -> None:
        """Reload when the file at the path changed, looked at most once a second."""
        now = time.monotonic()
        if now - self._checked < RELOAD_CHECK_S:
            return
        self._checked = now
        try:
            seen = _signature(os.stat(self.path))
        except OSError as e:
            log.error("allowlist unreadable; the previous one stays in force",
                      extra={"path": self.path, "reason": unreadable(self.path, e)})
            return
        if seen != self._seen:
            self.reload()

    def refusal(self, z85_key: str) -> str | None:
        """Why ``z85_key`` is not admitted now (``"not_allowed"``, ``"banned"``), or None."""
        self.maybe_reload()
        if self._banned and not self._ban_over(z85_key):
            return "banned"
        return None if z85_key in self._keys else "not_allowed"

    def admits(self, z85_key: str) -> bool:
        return self.refusal(z85_key) is None

    def name(self, z85_key: str) -> str:
        """The allowlist's comment for ``z85_key`` (its name), or ""."""
        return self._keys.get(z85_key, "")

    def ban(self, z85_key: str, seconds: float) -> None:
        """Refuse ``z85_key`` (connections and messages) for ``seconds``."""
        self._banned[z85_key] = time.monotonic() + seconds
        log.warning("key banned", extra={"key_fingerprint": fingerprint(z85_key), "seconds": seconds})

    def _ban_over(self, z85_key: str) -> bool:
        until = self._banned.get(z85_key)
        if until is None:
            return True
        if time.monotonic() < until:
            return False
        del self._banned[z85_key]
        return True


class Gatekeeper:
    """The ZAP handler of one context (RFC 27): admits a CURVE client whose key is on the
    allowlist; ``on_refused(reason)`` counts each refusal.

    It owns its REP socket and the event loop's reader on that socket's descriptor, and
    :meth:`stop` removes the reader before it closes the socket. (pyzmq's asyncio
    authenticator wraps its socket anew for every poll and drops that reader only in
    callbacks after the socket is closed; libzmq's reaper thread then closes the
    descriptor while uvloop still has it queued for the kernel, and uvloop aborts the
    process: a SIGTERM that arrived while the server was still starting did that, once
    in CI and at will in a test.)"""

    ENDPOINT = "inproc://zeromq.zap.01"  # fixed by RFC 27: libzmq asks whoever binds it
    VERSION = b"1.0"

    def __init__(self, ctx: zmq.Context, allowlist: Allowlist,
                 on_refused: Callable[[str], None] = lambda reason: None):
        self.allowlist = allowlist
        self._on_refused = on_refused
        self._ctx = ctx
        self._sock: zmq.Socket | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._fd = -1

    def admits(self, key: str) -> bool:
        """Whether the client whose public key is ``key`` (Z85) may connect."""
        why = self.allowlist.refusal(key)
        if why is not None:
            self._on_refused(why)
            what = "key not on the allowlist" if why == "not_allowed" else "key banned for now"
            log.warning(f"connection refused: {what}", extra={"key_fingerprint": fingerprint(key)})
        return why is None

    @classmethod
    def reply(cls, request: list[bytes], code: bytes, text: bytes, user_id: bytes = b"") -> list[bytes]:
        """The ZAP reply frames to ``request`` (its id, when it has one)."""
        return [cls.VERSION, request[1] if len(request) > 1 else b"", code, text, user_id, b""]

    def answer(self, request: list[bytes]) -> list[bytes]:
        """The ZAP reply to one request: 200 with the client's Z85 key as its user id (the
        server reads it back as a message's ``User-Id``), or 400 with the reason."""
        if len(request) < 6 or request[0] != self.VERSION:
            return self.reply(request, b"400", b"malformed ZAP request")
        domain, mechanism, credentials = request[2], request[5], request[6:]
        if domain != ZAP_DOMAIN.encode():
            return self.reply(request, b"400", b"unknown domain")
        if mechanism != b"CURVE" or len(credentials) != 1 or len(credentials[0]) != 32:
            return self.reply(request, b"400", b"CURVE only")
        key = z85.encode(credentials[0])
        if not self.admits(key.decode()):
            return self.reply(request, b"400", b"key refused")
        return self.reply(request, b"200", b"OK", key)

    def start(self) -> None:
        """Bind the ZAP endpoint and answer its requests on the running loop."""
        assert self._sock is None, "started already"
        self._loop = asyncio.get_running_loop()
        sock = zmq.Socket(self._ctx, zmq.REP)  # a plain socket: the loop watches its descriptor
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.bind(self.ENDPOINT)
            self._fd = int(sock.getsockopt(zmq.FD))
            self._loop.add_reader(self._fd, self._drain)
        except BaseException:
            sock.close(linger=0)
            raise
        self._sock = sock
        self._drain()  # what was asked before the reader was added: the edge is gone

    def _drain(self) -> None:
        """Answer every queued request. The descriptor is edge-triggered: it signals again
        only after a receive has found nothing (or ``EVENTS`` was read)."""
        sock = self._sock
        if sock is None:
            return
        while True:
            try:
                request = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                reply = self.answer(request)
            except Exception:  # never leave libzmq's handshake waiting on an answer
                log.exception("ZAP request could not be answered; refused")
                reply = self.reply(request, b"500", b"internal")
            sock.send_multipart(reply)

    def stop(self) -> None:
        """Remove the reader, then close the socket; safe to call twice."""
        sock, self._sock = self._sock, None
        if sock is None:
            return
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self._fd)
        sock.close(linger=0)


class Connections:
    """The TCP connections of one ROUTER socket, by file descriptor and peer host (from
    the socket's monitor), so that the server can hang up on a host: ZeroMQ has no way
    to close one peer of a bound socket, but shutting its TCP connection down makes
    libzmq drop it (an honest client reconnects by itself, a banned key is refused).
    It also counts the handshakes that failed before a key could be checked
    (``on_refused("handshake")``: a client with the wrong server key, or without keys);
    a key the allowlist refuses is the :class:`Gatekeeper`'s to count."""

    EVENTS = (zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CLOSED | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
              | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
    HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)

    def __init__(self, sock: zmq.Socket, on_refused: Callable[[str], None] = lambda reason: None):
        self._sock = sock
        self._on_refused = on_refused
        # made by the socket's context, an asyncio one (the server's): its recv is awaited
        self._monitor = cast(zmq.asyncio.Socket, sock.get_monitor_socket(self.EVENTS))
        self._hosts: dict[int, str] = {}  # fd -> peer IP
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.ensure_future(self._watch())

    async def _watch(self) -> None:
        while True:
            ev = parse_monitor_message(await self._monitor.recv_multipart())
            if ev["event"] in self.HANDSHAKE_FAILED:  # the value is an error code, not a descriptor
                self._on_refused("handshake")
                log.info("connection refused: CurveZMQ handshake failed (a client with the wrong server key, or "
                         "without keys)", extra={"error": int(ev["value"])})
                continue
            fd = int(ev["value"])
            if ev["event"] == zmq.EVENT_ACCEPTED:
                try:
                    with socket.socket(fileno=os.dup(fd)) as s:
                        self._hosts[fd] = s.getpeername()[0]
                except OSError:
                    pass
            else:
                self._hosts.pop(fd, None)

    def cut(self, host: str) -> int:
        """Shut down every connection from ``host``; returns how many."""
        n = 0
        for fd, peer in list(self._hosts.items()):
            if peer != host:
                continue
            try:
                with socket.socket(fileno=os.dup(fd)) as s:
                    s.shutdown(socket.SHUT_RDWR)
                n += 1
            except OSError:
                pass
            self._hosts.pop(fd, None)
        return n

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self._sock.disable_monitor()
        self._monitor.close(linger=0)

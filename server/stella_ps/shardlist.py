"""The job's shard addresses (``--shard-list PATH``), as ``joined`` and ``status`` hand
them to clients, so that a worker given one shard's address reaches them all
(:func:`stella.shards.connect`).

The file lists one address a line, in shard order (blank lines and ``#`` comments
skipped); the host ``*`` stands for the host a client reached this server at. The
supervisor of ``stella-ps --shards N`` writes it for its shards, after they have bound
when their ports are picked at start (``--bind ...:0``); an operator who starts shards
on several hosts may write one by hand. So it is read when it changes, not once: a
shard answers an empty list until the file is there. A list that cannot be right
(malformed, beyond the protocol's bounds, or not as long as the shard's ``I/N`` label
says) is logged once and not handed out: a client told a wrong list would split the
model wrongly.

Standard library only.
"""
from __future__ import annotations

import logging
import os

from stella.protocol import MAX_ADDRESS_BYTES, MAX_SHARDS

from .config import shard_position

__all__ = ["ShardList", "read_addresses"]

log = logging.getLogger("stella_ps.shardlist")


def read_addresses(text: str) -> list[str]:
    """The addresses of a shard list's text; ``ValueError`` naming the first bad line."""
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        host, sep, port = line.removeprefix("tcp://").rpartition(":")
        if not (line.startswith("tcp://") and sep and host and port.isdigit() and 0 < int(port) < 65536):
            raise ValueError(f"line {n}: {line!r} is not tcp://HOST:PORT")
        if len(line.encode()) > MAX_ADDRESS_BYTES:
            raise ValueError(f"line {n}: longer than {MAX_ADDRESS_BYTES} bytes")
        out.append(line)
    if len(out) > MAX_SHARDS:
        raise ValueError(f"{len(out)} addresses, more than the {MAX_SHARDS} a job may have")
    return out


class ShardList:
    """``--shard-list``'s addresses now: :meth:`addresses` reads the file again when its
    inode, size or modification time changed (a ``stat`` otherwise). ``shard`` is this
    server's ``I/N`` label ("" for none): a list of another length is not handed out."""

    def __init__(self, path: str | None, shard: str = ""):
        self.path, self.shard = path, shard
        position = shard_position(shard)
        self._count = position[1] if position is not None else None
        self._seen: tuple[int, int, int] | None = None
        self._addresses: list[str] = []
        self._why = ""  # the last refusal logged

    def addresses(self) -> list[str]:
        if self.path is None:
            return []
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return []  # not written yet (the supervisor writes it once its shards have bound)
        except OSError as e:
            self._refuse(None, f"cannot read it: {e}")
            return []
        key = (st.st_ino, st.st_mtime_ns, st.st_size)  # os.replace makes a new inode
        if key != self._seen:
            self._seen = key
            self._addresses = []
            try:
                with open(self.path) as f:
                    addresses = read_addresses(f.read())
            except (OSError, ValueError) as e:
                self._refuse(key, str(e))
                return []
            if self._count is not None and len(addresses) != self._count:
                self._refuse(key, f"{len(addresses)} addresses, but this server is shard {self.shard}")
                return []
            self._addresses = addresses
            log.info("shard list", extra={"shard_list": self.path, "shards": addresses})
        return list(self._addresses)

    def _refuse(self, key: tuple[int, int, int] | None, why: str) -> None:
        self._seen = key
        if why != self._why:
            self._why = why
            log.error("the shard list is not handed out to clients", extra={"shard_list": self.path, "why": why})

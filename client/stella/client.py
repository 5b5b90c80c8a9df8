"""``stella.Client``: the connection a training script uses to talk to ``stella-ps``.

A client owns one ZeroMQ DEALER socket. Requests carry an id; replies are matched
by it, so several requests can be in flight (``send_*`` then ``wait``), which the
pipelined optimizer uses to overlap a push and the following pull. A client is
not thread-safe: use it from one thread (the pipeline gives its background thread
its own client).
"""
from __future__ import annotations

import itertools
import os
import time
import weakref
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

import numpy as np
import zmq

from . import codec
from .errors import ProtocolError, ServerUnavailable, from_reply
from .wire import TensorSpec, pack_header, unpack_header

__all__ = ["Client", "PullResult", "DEFAULT_TIMEOUT_S", "ENV_TIMEOUT"]

ENV_TIMEOUT = "STELLA_TIMEOUT"
DEFAULT_TIMEOUT_S = float(os.environ.get(ENV_TIMEOUT, "60"))

_TORCH_DTYPES = {"torch.float32": "float32", "torch.float16": "float16", "torch.bfloat16": "bfloat16"}


def _to_numpy_f32(x: Any) -> np.ndarray:
    if hasattr(x, "detach"):  # torch tensor, without importing torch here
        x = x.detach().to("cpu")
        if str(x.dtype) != "torch.float32":
            x = x.float()
        return x.contiguous().numpy().reshape(-1)
    return np.ascontiguousarray(x, dtype=np.float32).reshape(-1)


def _dtype_name(x: Any) -> str:
    if hasattr(x, "detach"):
        name = _TORCH_DTYPES.get(str(x.dtype))
    else:
        name = {np.dtype(np.float32): "float32", np.dtype(np.float16): "float16"}.get(np.asarray(x).dtype)
    if name is None:
        raise TypeError(f"unsupported tensor dtype {x.dtype}; use float32, float16 or bfloat16")
    return name


@dataclass
class PullResult:
    """What changed on the server: per tensor name ``(indices or None if dense, float32 values)``."""

    version: int
    full: bool
    tensors: dict[str, tuple[np.ndarray | None, np.ndarray]]

    @property
    def count(self) -> int:
        return sum(v.size for _, v in self.tensors.values())

    def apply_to(self, params: Mapping[str, Any]) -> None:
        """Install the values into local tensors (NumPy arrays or torch tensors, any device)."""
        for name, (idx, vals) in self.tensors.items():
            dst = params[name]
            if hasattr(dst, "detach"):
                import torch

                flat = dst.detach().view(-1)
                # frames are read-only buffers; torch wants writable memory
                src = torch.from_numpy(vals if vals.flags.writeable else vals.copy()).to(flat.device, flat.dtype)
                if idx is None:
                    flat.copy_(src)
                else:
                    flat[torch.from_numpy(idx.astype(np.int64)).to(flat.device)] = src
            else:
                flat = dst.reshape(-1)
                if idx is None:
                    flat[:] = vals
                else:
                    flat[idx] = vals


class Client:
    """Connection to one stella-ps.

    ``Client(address)`` connects and joins; ``register`` declares the model (the first
    registration initialises the server's store); then ``push`` and ``pull`` each step.
    Every blocking call takes ``timeout`` (seconds; default ``STELLA_TIMEOUT`` or 60) and
    raises :class:`ServerUnavailable` when it passes.
    """

    def __init__(
        self,
        address: str,
        *,
        timeout: float | None = None,
        name: str = "",
        worker_id: int | None = None,
        join: bool = True,
        ctx: zmq.Context | None = None,
    ):
        self.address = address
        self.timeout = DEFAULT_TIMEOUT_S if timeout is None else float(timeout)
        self.name = name or f"pid{os.getpid()}"
        self.worker_id: int | None = worker_id
        self.layout: list[TensorSpec] = []
        self._index: dict[str, int] = {}
        self.bytes_pushed = 0
        self.bytes_pulled = 0
        self._req = itertools.count(1)
        self._replies: dict[int, tuple[dict, list]] = {}
        self._outstanding: set[int] = set()
        ctx = ctx or zmq.Context.instance()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IMMEDIATE, 1)  # never queue a request for a peer that is not connected
        sock.setsockopt(zmq.HEARTBEAT_IVL, 5000)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 30000)
        sock.connect(address)
        self._sock = sock
        self._finalizer = weakref.finalize(self, sock.close, 0)
        if join:
            self.join(worker_id)

    # ------------------------------------------------------------------ plumbing
    def send(self, msg_type: str, frames: Sequence[Any] = (), *, timeout: float | None = None, **fields: Any) -> int:
        """Send a request without waiting; returns its id for :meth:`wait`."""
        if self._sock.closed:
            raise ServerUnavailable("client is closed")
        t = self.timeout if timeout is None else timeout
        if not self._sock.poll(int(t * 1000), zmq.POLLOUT):
            raise ServerUnavailable(f"cannot reach stella-ps at {self.address} within {t:.1f}s")
        req = next(self._req)
        hdr = pack_header(msg_type, req, **fields)
        self._sock.send_multipart([hdr, *frames], copy=False)
        self.bytes_pushed += len(hdr) + sum(memoryview(f).nbytes for f in frames)
        self._outstanding.add(req)
        return req

    def wait(self, req: int, *, timeout: float | None = None) -> tuple[dict, list]:
        """Wait for the reply to request ``req``; raises the server's error if it sent one."""
        t = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + t
        while req not in self._replies:
            left = deadline - time.monotonic()
            if left <= 0 or not self._sock.poll(int(max(left, 0) * 1000) + 1, zmq.POLLIN):
                self._outstanding.discard(req)
                raise ServerUnavailable(f"no reply from stella-ps at {self.address} within {t:.1f}s")
            parts = self._sock.recv_multipart(copy=False)
            self.bytes_pulled += sum(len(p) for p in parts)
            hdr = unpack_header(parts[0].buffer, expect="reply")
            if hdr["req"] in self._outstanding:  # replies to abandoned requests are dropped
                self._replies[hdr["req"]] = (hdr, parts[1:])
        self._outstanding.discard(req)
        hdr, frames = self._replies.pop(req)
        if hdr["type"] == "error":
            raise from_reply(str(hdr.get("code")), str(hdr.get("message")))
        return hdr, frames

    def request(self, msg_type: str, frames: Sequence[Any] = (), *, timeout: float | None = None, **fields):
        return self.wait(self.send(msg_type, frames, timeout=timeout, **fields), timeout=timeout)

    def _tensor(self, name: str) -> int:
        try:
            return self._index[name]
        except KeyError:
            raise KeyError(f"tensor {name!r} is not in the registered model") from None

    # ------------------------------------------------------------------ API
    def join(self, worker_id: int | None = None, *, timeout: float | None = None) -> int:
        fields = {"name": self.name}
        if worker_id is not None:
            fields["worker"] = worker_id
        hdr, _ = self.request("join", timeout=timeout, **fields)
        self.worker_id = hdr["worker"]
        return self.worker_id

    def register(
        self,
        tensors: Mapping[str, Any] | Iterable[tuple[str, Any]],
        optimizer: Mapping[str, Any] | None = None,
        *,
        timeout: float | None = None,
    ) -> dict[str, Any]:
        """Declare the model layout; the first registration also sends the initial values.

        Later workers with the same layout join the existing model (pull a full
        snapshot afterwards); a different layout raises :class:`LayoutConflict`.
        Returns the server's reply (``version``, ``created``, ``optimizer``).
        """
        items = list(tensors.items() if isinstance(tensors, Mapping) else tensors)
        layout = [TensorSpec(n, tuple(int(s) for s in t.shape), _dtype_name(t)) for n, t in items]
        fields = {"worker": self.worker_id, "tensors": [s.to_wire() for s in layout],
                  "optimizer": dict(optimizer or {})}
        from .errors import NotRegistered

        try:  # cheap probe first: joining an existing model sends no values
            hdr, _ = self.request("register", timeout=timeout, values=False, **fields)
        except NotRegistered:
            frames = [_to_numpy_f32(t) for _, t in items]
            hdr, _ = self.request("register", frames, timeout=timeout, values=True, **fields)
        self.layout = layout
        self._index = {s.name: i for i, s in enumerate(layout)}
        return hdr

    def push(
        self,
        grads: Mapping[str, Any],
        version: int,
        *,
        value_dtype: str = "f32",
        index_coding: str = "raw32",
        timeout: float | None = None,
        wait: bool = True,
    ):
        """Push one step's gradient, computed on model ``version``.

        ``grads`` maps tensor names to a sparse gradient (an object with ``indices``
        and ``values``, e.g. :class:`stella.compress.SparseGrad`, or a pair
        ``(indices, values)`` with sorted unique indices; ``indices`` None means dense)
        or to a dense array. Returns the server's reply (``step`` the push joined),
        or the request id when ``wait=False``.
        """
        entries, frames = [], []
        for name, g in grads.items():
            t = self._tensor(name)
            if hasattr(g, "indices") and hasattr(g, "values"):
                idx, vals = g.indices, g.values
            elif isinstance(g, tuple):
                idx, vals = g
            else:
                idx, vals = None, g
            vals = _to_numpy_f32(vals)
            if idx is None:
                entries.append({"t": t, "n": int(vals.size), "ic": "dense", "vd": value_dtype})
            else:
                idx = np.asarray(idx)
                entries.append({"t": t, "n": int(idx.size), "ic": index_coding, "vd": value_dtype})
                frames.append(codec.encode_indices(idx, self.layout[t].numel, index_coding))
            frames.append(codec.encode_values(vals, value_dtype))
        req = self.send("push", frames, timeout=timeout, worker=self.worker_id, version=int(version), tensors=entries)
        if not wait:
            return req
        return self.wait(req, timeout=timeout)[0]

    def pull(
        self,
        since: int | None = None,
        *,
        wait_for: int | None = None,
        index_coding: str = "raw32",
        timeout: float | None = None,
    ) -> PullResult:
        """What changed after version ``since`` (None: a full snapshot).

        With ``wait_for``, the server holds the reply until its version reaches it
        (or ``timeout`` passes, then it answers with what it has).
        """
        return self.wait_pull(self.send_pull(since, wait_for=wait_for, index_coding=index_coding, timeout=timeout),
                              timeout=timeout)

    def send_pull(self, since: int | None = None, *, wait_for: int | None = None, index_coding: str = "raw32",
                  timeout: float | None = None) -> int:
        t = self.timeout if timeout is None else timeout
        fields: dict[str, Any] = {"worker": self.worker_id, "since": -1 if since is None else int(since),
                                  "ic": index_coding}
        if wait_for is not None:
            fields["wait_for"] = int(wait_for)
            fields["timeout_ms"] = int(t * 1000 * 0.9)  # the server answers before we give up
        return self.send("pull", timeout=timeout, **fields)

    def wait_pull(self, req: int, *, timeout: float | None = None) -> PullResult:
        hdr, frames = self.wait(req, timeout=timeout)
        out: dict[str, tuple[np.ndarray | None, np.ndarray]] = {}
        fi = 0
        for e in hdr.get("tensors", []):
            t, n, ic = e["t"], e["n"], e["ic"]
            if not (isinstance(t, int) and 0 <= t < len(self.layout)):
                raise ProtocolError(f"pull reply names unknown tensor {t!r}")
            spec = self.layout[t]
            if ic == "dense":
                idx = None
            else:
                idx = codec.decode_indices(frames[fi].buffer, n, spec.numel, ic)
                fi += 1
            out[spec.name] = (idx, codec.decode_values(frames[fi].buffer, n, "f32"))
            fi += 1
        return PullResult(hdr["version"], bool(hdr["full"]), out)

    def status(self, *, timeout: float | None = None) -> dict[str, Any]:
        hdr, _ = self.request("status", timeout=timeout)
        return {k: v for k, v in hdr.items() if k not in ("type", "proto", "req")}

    def set_optimizer(self, *, timeout: float | None = None, **hparams: Any) -> dict[str, Any]:
        """Change optimizer hyper-parameters (e.g. ``lr``) from the next step on."""
        hdr, _ = self.request("set_optimizer", timeout=timeout, worker=self.worker_id, hparams=hparams)
        return hdr["optimizer"]

    def leave(self, *, timeout: float | None = None) -> None:
        if self.worker_id is not None:
            self.request("leave", timeout=timeout, worker=self.worker_id)

    def close(self, *, leave: bool = True, timeout: float = 5.0) -> None:
        """Leave the job (best effort) and close the socket; safe to call twice."""
        if self._sock.closed:
            return
        if leave and self.worker_id is not None:
            try:
                self.leave(timeout=timeout)
            except Exception:
                pass
        self._finalizer()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

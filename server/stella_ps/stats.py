"""What the job looks like from outside: the server's counters (:class:`Stats`) and
one :class:`JobSnapshot` of the whole state, built in one place
(:meth:`stella_ps.service.Service.snapshot`) and rendered by the ``status`` reply
(:meth:`JobSnapshot.status_reply`), the Prometheus collector and ``/healthz``
(:mod:`stella_ps.metrics`), so they can never disagree. The snapshot holds the status
reply itself, not a copy of its fields.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import msgspec

from stella.protocol import StatusReply

__all__ = ["Stats", "JobSnapshot", "STATUS_FIELDS"]

# the fields of the status reply a snapshot fills (all but the envelope's)
STATUS_FIELDS = tuple(f for f in StatusReply.__struct_fields__ if f not in ("proto", "req"))


@dataclass
class Stats:
    """Counters the service, the step scheduler, the checkpointer and the transport
    write (each its own); read only through a :class:`JobSnapshot`."""

    started: float = field(default_factory=time.time)  # wall clock, for the uptime
    bytes_in: int = 0
    bytes_out: int = 0
    messages: int = 0
    errors: int = 0
    errors_by_code: dict[str, int] = field(default_factory=dict)
    pushes: int = 0
    duplicate_pushes: int = 0  # pushes re-sent after a reconnect and not queued again
    pulls: int = 0
    steps: int = 0
    late_pushes: int = 0
    workers_gone: int = 0  # workers declared gone (liveness timeout)
    # connections refused at the CurveZMQ handshake, by reason (security.REFUSED)
    refused_connections: dict[str, int] = field(default_factory=dict)
    # steps' timings, exported as Prometheus summaries (sum and count): the time between
    # two consecutive steps closing, the store's apply, and how long a step stayed open
    # after its first push (waiting for the last worker, or the deadline)
    step_interval_s: float = 0.0
    step_intervals: int = 0
    apply_s: float = 0.0
    straggler_wait_s: float = 0.0
    last_step_at: float | None = None  # monotonic time the latest step closed
    rejected_steps: int = 0  # steps the finite-step guard undid (and applied without some pushes, or empty)
    rejected_pushes: int = 0  # pushes those steps dropped
    checkpoints: int = 0  # written since start
    checkpoint_stall_s: float = 0.0  # the longest a checkpoint's copy held a step back
    last_checkpoint: float | None = None  # wall clock of the latest checkpoint written
    checkpoint_failures: int = 0  # checkpoint writes failed since start
    checkpoint_error: str | None = None  # why the latest write failed; None once one succeeds again

    _COUNTERS = ("bytes_in", "bytes_out", "messages", "errors", "pushes", "duplicate_pushes", "pulls", "steps",
                 "late_pushes", "workers_gone", "step_interval_s", "step_intervals", "apply_s", "straggler_wait_s",
                 "rejected_steps", "rejected_pushes", "checkpoints", "checkpoint_stall_s", "checkpoint_failures")

    def counters(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """The counters as a :class:`JobSnapshot` shows them: those the ``status`` reply
        carries (named as its fields), and those only the metrics show (copies of the maps)."""
        every = {**{k: getattr(self, k) for k in self._COUNTERS}, "errors_by_code": dict(self.errors_by_code),
                 "refused_connections": dict(self.refused_connections), "uptime_s": time.time() - self.started,
                 "checkpoint_error": self.checkpoint_error}
        return ({k: v for k, v in every.items() if k in STATUS_FIELDS},
                {k: v for k, v in every.items() if k not in STATUS_FIELDS})

    def count_step(self, now: float, applied_s: float, opened: float | None) -> None:
        """One step closed at ``now`` (monotonic) after ``applied_s`` of apply; ``opened``:
        when its first push arrived. (Its late pushes were counted when it was taken.)"""
        self.steps += 1
        self.apply_s += applied_s
        if opened is not None:
            self.straggler_wait_s += max(0.0, now - applied_s - opened)
        if self.last_step_at is not None:
            self.step_interval_s += now - self.last_step_at
            self.step_intervals += 1
        self.last_step_at = now

    def count_error(self, code: str) -> None:
        self.errors += 1
        self.errors_by_code[code] = self.errors_by_code.get(code, 0) + 1

    def count_refused(self, reason: str) -> None:
        self.refused_connections[reason] = self.refused_connections.get(reason, 0) + 1


@dataclass(frozen=True)
class JobSnapshot:
    """The job at one instant: the ``status`` reply (``req`` 0) and the counters only
    the metrics show."""

    status: StatusReply
    # --- the metrics' only
    errors_by_code: dict[str, int]
    duplicate_pushes: int
    workers_gone: int
    refused_connections: dict[str, int]
    step_interval_s: float
    step_intervals: int
    apply_s: float
    straggler_wait_s: float
    checkpoints: int
    checkpoint_stall_s: float
    rejected_steps: int
    rejected_pushes: int
    clipped_pushes: int

    def status_reply(self, req: int) -> StatusReply:
        """The reply to the ``status`` request ``req``."""
        return msgspec.structs.replace(self.status, req=req)

"""The Prometheus endpoint (``--metrics HOST:PORT``) and ``/healthz``, served on the
daemon's own event loop.

Nothing is counted twice: at each scrape the collector renders one
:class:`~stella_ps.stats.JobSnapshot`, the same the ``status`` reply is built from
(:meth:`stella_ps.service.Service.snapshot`), and so does ``/healthz``; so metrics
cost nothing between scrapes, and ``status``, ``/metrics`` and ``/healthz`` always
agree. The HTTP side is a few lines of ``asyncio.start_server`` rather than
prometheus-client's threaded server: the snapshot is then taken on the loop that
writes the service's state, and a health check that gets an answer knows that loop
is turning.

Series (all prefixed ``stella_``; per-worker series carry ``worker`` and ``name``):

=================================  =======  ==============================================
``info``                           gauge    1, labels ``version`` (release), ``protocol``,
                                            ``native_isa`` (the C kernel's x86-64 level),
                                            ``shard`` (``I/N`` of a sharded job, or empty)
``model_version``                  gauge    applied steps (the model's version)
``live_workers``                   gauge    workers that joined and did not leave
``expected_workers``               gauge    ``--workers``
``steps_total``                    counter  steps applied
``step_seconds``                   summary  wall time between two steps closing
``step_apply_seconds``             summary  the store's apply of a step (C kernel)
``straggler_wait_seconds``         summary  a step's first push to its close
``pushes_total`` / ``pulls_total`` counter  per worker
``late_pushes_total``              counter  pushes folded into a later step
``duplicate_pushes_total``         counter  pushes re-sent after a reconnect, not queued twice
``workers_gone_total``             counter  workers declared gone (liveness timeout)
``refused_connections_total``      counter  connections refused at the handshake, label
                                            ``reason``: ``not_allowed`` (key not on the
                                            allowlist), ``banned``, ``handshake`` (wrong
                                            server key, or no keys)
``checkpoints_total``              counter  checkpoints written since start
``checkpoint_failures_total``      counter  checkpoint writes failed since start (full disk,
                                            read-only directory, ...: README "Operations")
``checkpoint_failing``             gauge    1 while the latest checkpoint write failed (why:
                                            ``stella status`` and the log), 0 once one succeeds
``checkpoint_stall_seconds``       gauge    the longest a checkpoint's copy held a step back
``rejected_steps_total``           counter  steps undone by the finite-step guard (NaN/Inf result)
``rejected_pushes_total``          counter  pushes those steps dropped
``clipped_pushes_total``           counter  pushes scaled down to a push-norm bound
``bytes_received_total``           counter  bytes in (all messages)
``bytes_sent_total``               counter  bytes out
``errors_total``                   counter  refused requests, label ``code``
``worker_last_seen_seconds``       gauge    since the worker's last push or pull
``worker_density``                 gauge    the fraction its latest push carried
``worker_max_density``             gauge    the densest push worth its own work (its controller's cap)
``worker_compute_seconds``         gauge    its latest iteration's computation
``worker_exchange_seconds``        gauge    its latest exchange (background)
``worker_wait_seconds``            gauge    its latest wait for the exchange in ``step()``
``worker_steps``                   gauge    its iterations so far
``worker_value_bits``              gauge    bits per value of its latest push (its coding)
``worker_local_steps``             gauge    local steps (H) of its latest round
``worker_accumulate``              gauge    micro-batches per step of its latest round
``worker_uplink_bytes_per_second`` gauge    its measured uplink (``..._downlink_...``: down)
``checkpoint_age_seconds``         gauge    NaN until a checkpoint has been written or resumed from
=================================  =======  ==============================================

The ``worker_*`` timings are what the workers report with their pushes
(:class:`stella.protocol.WorkerReport`); a worker that sends none has no such series.
"""
from __future__ import annotations

import asyncio
import json
import logging
import math
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric, SummaryMetricFamily
from prometheus_client.registry import Collector

from stella.codec import VALUE_BITS
from stella.protocol import PROTOCOL_VERSION

from .config import parse_bind
from .kernel import native_isa
from .security import REFUSED
from .stats import JobSnapshot

__all__ = ["JobCollector", "MetricsServer", "CONTENT_TYPE"]

log = logging.getLogger("stella_ps.metrics")
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
REQUEST_TIMEOUT_S = 10.0
MAX_REQUEST_BYTES = 8192


class JobCollector(Collector):
    """Renders the job's snapshot at scrape time (see the module's table)."""

    def __init__(self, snapshot: Callable[[], JobSnapshot]):
        self._snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        snap = self._snapshot()
        st = snap.status
        info = GaugeMetricFamily("stella_info", "stella-ps release, protocol version, C kernel's x86-64 level, "
                                 "shard I/N of a sharded job", labels=["version", "protocol", "native_isa", "shard"])
        info.add_metric([st.server_version, str(PROTOCOL_VERSION), native_isa().level, st.shard], 1)
        yield info
        yield GaugeMetricFamily("stella_model_version", "applied steps: the model's version", value=st.version)
        yield GaugeMetricFamily("stella_live_workers", "workers joined and not left", value=len(st.workers))
        yield GaugeMetricFamily("stella_expected_workers", "workers the first step waits for (--workers)",
                                value=st.expected_workers)
        yield CounterMetricFamily("stella_steps", "steps applied", value=st.steps)
        yield SummaryMetricFamily("stella_step_seconds", "wall time between two steps closing",
                                  count_value=snap.step_intervals, sum_value=snap.step_interval_s)
        yield SummaryMetricFamily("stella_step_apply_seconds", "the store's apply of a step",
                                  count_value=st.steps, sum_value=snap.apply_s)
        yield SummaryMetricFamily("stella_straggler_wait_seconds",
                                  "from a step's first push until it closed (waiting for stragglers)",
                                  count_value=st.steps, sum_value=snap.straggler_wait_s)
        yield CounterMetricFamily("stella_late_pushes", "pushes folded into a later step", value=st.late_pushes)
        yield CounterMetricFamily("stella_duplicate_pushes", "pushes re-sent after a reconnect and not queued twice",
                                  value=snap.duplicate_pushes)
        yield CounterMetricFamily("stella_workers_gone", "workers declared gone (liveness timeout)",
                                  value=snap.workers_gone)
        refused = CounterMetricFamily("stella_refused_connections",
                                      "connections refused at the CurveZMQ handshake, by reason", labels=["reason"])
        for reason in REFUSED:
            refused.add_metric([reason], snap.refused_connections.get(reason, 0))
        yield refused
        yield CounterMetricFamily("stella_bytes_received", "bytes received, all messages", value=st.bytes_in)
        yield CounterMetricFamily("stella_bytes_sent", "bytes sent, all messages", value=st.bytes_out)
        errors = CounterMetricFamily("stella_errors", "refused requests by error code", labels=["code"])
        for code, n in sorted(snap.errors_by_code.items()):
            errors.add_metric([code], n)
        yield errors
        age = st.checkpoint_age_s
        yield GaugeMetricFamily("stella_checkpoint_age_seconds", "seconds since the latest checkpoint (NaN: none)",
                                value=math.nan if age is None else age)
        yield CounterMetricFamily("stella_checkpoints", "checkpoints written since start", value=snap.checkpoints)
        yield CounterMetricFamily("stella_checkpoint_failures", "checkpoint writes failed since start",
                                  value=st.checkpoint_failures)
        yield GaugeMetricFamily("stella_checkpoint_failing", "1 while the latest checkpoint write failed "
                                "(why: stella status, the log), 0 once one succeeds",
                                value=int(st.checkpoint_error is not None))
        yield CounterMetricFamily("stella_rejected_steps", "steps the finite-step guard undid (a result was NaN/Inf)",
                                  value=snap.rejected_steps)
        yield CounterMetricFamily("stella_rejected_pushes", "pushes such steps dropped", value=snap.rejected_pushes)
        yield CounterMetricFamily("stella_clipped_pushes", "pushes scaled down to a push-norm bound",
                                  value=snap.clipped_pushes)
        yield GaugeMetricFamily("stella_checkpoint_stall_seconds", "the longest a checkpoint's copy held a step back",
                                value=snap.checkpoint_stall_s)
        labels = ["worker", "name"]
        fams: dict[str, CounterMetricFamily | GaugeMetricFamily] = {
            "pushes": CounterMetricFamily("stella_pushes", "pushes per worker", labels=labels),
            "pulls": CounterMetricFamily("stella_pulls", "pulls per worker", labels=labels),
            "seen": GaugeMetricFamily("stella_worker_last_seen_seconds", "seconds since its latest push or pull",
                                      labels=labels),
            "max_density": GaugeMetricFamily("stella_worker_max_density", "the densest push worth its own work a "
                                             "round (its controller's cap)", labels=labels),
            "density": GaugeMetricFamily("stella_worker_density", "fraction of each tensor its latest push carried",
                                         labels=labels),
            "compute": GaugeMetricFamily("stella_worker_compute_seconds", "its latest iteration's computation",
                                         labels=labels),
            "exchange": GaugeMetricFamily("stella_worker_exchange_seconds", "its latest exchange (background)",
                                          labels=labels),
            "wait": GaugeMetricFamily("stella_worker_wait_seconds", "its latest wait for the exchange in step()",
                                      labels=labels),
            "steps": GaugeMetricFamily("stella_worker_steps", "its iterations so far", labels=labels),
            "value_bits": GaugeMetricFamily("stella_worker_value_bits", "bits per value of its latest push's coding "
                                            "(its controller's choice: f16 16, q4 4.5, q2 2.5)", labels=labels),
            "local_steps": GaugeMetricFamily("stella_worker_local_steps", "local steps (H) of its latest round",
                                             labels=labels),
            "accumulate": GaugeMetricFamily("stella_worker_accumulate", "micro-batches per step of its latest round",
                                            labels=labels),
            "up": GaugeMetricFamily("stella_worker_uplink_bytes_per_second", "its measured uplink rate",
                                    labels=labels),
            "down": GaugeMetricFamily("stella_worker_downlink_bytes_per_second", "its measured downlink rate",
                                      labels=labels),
        }
        for ws in st.live or []:
            lv = [str(ws.worker), ws.name]
            fams["pushes"].add_metric(lv, ws.pushes)
            fams["pulls"].add_metric(lv, ws.pulls)
            fams["seen"].add_metric(lv, ws.last_seen_s)
            r = ws.report
            if r is not None:
                fams["density"].add_metric(lv, r.density)
                if r.max_density:
                    fams["max_density"].add_metric(lv, r.max_density)
                fams["compute"].add_metric(lv, r.compute_s)
                fams["exchange"].add_metric(lv, r.exchange_s)
                fams["wait"].add_metric(lv, r.wait_s)
                fams["steps"].add_metric(lv, r.step)
                if r.value_dtype is not None:
                    fams["value_bits"].add_metric(lv, VALUE_BITS[r.value_dtype])
                if r.local_steps:
                    fams["local_steps"].add_metric(lv, r.local_steps)
                if r.accumulate:
                    fams["accumulate"].add_metric(lv, r.accumulate)
                if r.up_bps:
                    fams["up"].add_metric(lv, r.up_bps)
                if r.down_bps:
                    fams["down"].add_metric(lv, r.down_bps)
        yield from fams.values()


class MetricsServer:
    """``GET /metrics`` (Prometheus text format) and ``GET /healthz`` (a small JSON
    object; 200 while the server runs) on ``host:port``, on the running loop."""

    def __init__(self, snapshot: Callable[[], JobSnapshot], bind: str):
        self.host, self.port = parse_bind(bind)
        self._snapshot = snapshot  # the service's: the job now
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(JobCollector(snapshot))
        self._server: asyncio.AbstractServer | None = None

    async def start(self) -> str:
        """Listen; returns ``host:port`` as bound (port 0 becomes the port picked)."""
        # the reader's limit bounds a request head before it is held
        self._server = await asyncio.start_server(self._handle, self.host, self.port, limit=MAX_REQUEST_BYTES)
        self.port = self._server.sockets[0].getsockname()[1]
        log.info("metrics listening", extra={"metrics": f"{self.host}:{self.port}"})
        return f"{self.host}:{self.port}"

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None

    async def __aenter__(self) -> MetricsServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def health(self) -> dict[str, Any]:
        """``/healthz``'s answer, from the job's snapshot (answered at all: the loop turns)."""
        st = self._snapshot().status
        return {"status": "ok", "version": st.version, "live_workers": len(st.workers), "steps": st.steps,
                "release": st.server_version, "shard": st.shard}

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), REQUEST_TIMEOUT_S)
            if len(head) > MAX_REQUEST_BYTES:
                raise ValueError("request too large")
            method, path, *_ = head.split(b"\r\n", 1)[0].decode("latin-1").split(" ")
            path = path.split("?", 1)[0]
            if method not in ("GET", "HEAD"):
                status, ctype, body = "405 Method Not Allowed", "text/plain", b"GET only\n"
            elif path == "/metrics":
                status, ctype, body = "200 OK", CONTENT_TYPE, generate_latest(self.registry)
            elif path == "/healthz":
                status, ctype, body = "200 OK", "application/json", json.dumps(self.health()).encode() + b"\n"
            else:
                status, ctype, body = "404 Not Found", "text/plain", b"try /metrics or /healthz\n"
            writer.write(f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n"
                         f"Connection: close\r\n\r\n".encode() + (b"" if method == "HEAD" else body))
            await writer.drain()
        except (asyncio.TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError,
                ConnectionError):
            pass  # a client that sends no complete request gets nothing
        except Exception:  # pragma: no cover - a bug must not take the server down
            log.exception("metrics request failed")
        finally:
            writer.close()

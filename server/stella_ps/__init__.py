"""stella-ps: the parameter-server daemon.

Where each concern lives:

- ``daemon``: the ``stella-ps`` entry point: logging, signals, the uvloop event loop
  (``__main__``: ``python -m stella_ps`` runs it).
- ``supervisor``: ``stella-ps --shards N``, the shards of one job on one host from one
  command: starts them (ports, metrics, checkpoint directories, threads, cores), lists
  them, restarts one that dies, stops them all.
- ``shardlist``: ``--shard-list``, the job's shard addresses a shard hands its clients.
- ``config``: every setting declared once (flag, environment variable, help, check),
  parsed into a frozen ``ServerConfig`` of ``Limits``, ``Liveness``, ``Deadline`` and
  ``Checkpoints``; ``parse_bind``.
- ``server``: transport and lifecycle: the ROUTER socket, decoding every message
  with :mod:`stella.protocol`, sending replies, taking and releasing every resource.
- ``security``: CurveZMQ keys, the allowlist and the ZAP handler that enforces it.
- ``service``: one handler per request type, and the composition of the parts below.
- ``registration``: model creation: the probe held while another worker uploads, the
  upload, the layout and mode checks, the digest base.
- ``steps``: when a step closes and with which optimizer configuration (its only
  writer): the deadline, silent and behind workers, lost workers, the apply loop (a
  step whole or not at all: a failed one closes empty; one that cannot be undone stops
  the server).
- ``aggregation``: pending pushes, what a closed step takes, the mean's scale, late
  pushes, the adaptive deadline, the push-norm bound.
- ``membership``: worker ids, the connections they belong to, liveness.
- ``waiters``: pulls waiting for a future version; ``answers``: pulls answered (the
  answer a step prepared, sent from the loop; the rest in one trip to the store thread).
- ``transfers``: large messages in pieces over slow links: answers held for their
  workers' fetches, uploads (the model's values, a push) taken piece by piece.
- ``store``: the model, its version, the history of touched coordinates, encoded deltas,
  the undo of a step that failed part way, and the primitives a checkpoint copies it with.
- ``broadcast``: the compressed broadcast pulls answer: its model ``B`` and residual
  ``R``, each step's selection and message, the candidate pool, the step log a
  checkpoint replays; ``topk``: its streaming top-k pass (``Selector``, the workers'
  C selection compiled into the server's module); ``residual``: ``FlatResidual``, the
  residual over the flat model with an index of its largest magnitudes kept current by
  each add, so that a step's top-k costs what it touched and selected (``native/residual.c``).
- ``checkpoints``: resume, periodic and final checkpoints, the sliced copy rolled forward
  to one version, the checkpoint's arrays.
- ``stats``: the counters and the one ``JobSnapshot`` that ``status`` and the metrics render.
- ``runtime``: the store thread, background tasks, the clock (faked in tests).
- ``optim`` (configuration and validation), ``optim_ref`` (the executable specification
  of the lazy optimizers) and ``kernel`` (the C kernel behind a checked wrapper, with the
  broadcast's scatter, pool and union primitives).
- ``process``: ``ServerProcess``, the one way to start a ``stella-ps`` from Python
  (demo, benchmarks, tests; the supervisor starts its shards itself).
- ``metrics``: the Prometheus endpoint (``--metrics``) and ``/healthz``.
- ``health``: ``stella-ps-health``, the container health check asking that endpoint.
- ``errors``: the package's exception root.
"""
__version__ = "0.1.0"  # the release, as pyproject.toml says

"""stella-ps: the parameter-server daemon.

Where each concern lives:

- ``daemon``: the ``stella-ps`` entry point: logging, signals, the uvloop event loop.
- ``config``: flags and environment overrides, parsed into a frozen ``ServerConfig``.
- ``server``: transport and lifecycle: the ROUTER socket, decoding every message
  with :mod:`stella.protocol`, sending replies, stopping.
- ``service``: one handler per request type, the optimizer configuration (its only
  writer) and the scheduling of steps.
- ``membership``: worker ids and the connections they belong to.
- ``aggregation``: when a step closes, what it takes, the mean's scale, late pushes.
- ``waiters``: pulls waiting for a future version.
- ``store``: the model, its version, the history of touched coordinates, encoded deltas.
- ``optim`` (configuration and validation), ``optim_ref`` (the executable specification
  of the lazy optimizers) and ``kernel`` (the C kernel behind a checked wrapper).
- ``process``: ``ServerProcess``, the one way to start a ``stella-ps`` from Python
  (demo, benchmarks, tests).
- ``metrics``: the Prometheus endpoint (``--metrics``) and ``/healthz``.
- ``health``: ``stella-ps-health``, the container health check asking that endpoint.
- ``errors``: the package's exception root.
"""
__version__ = "0.1.0"  # the release, as pyproject.toml says

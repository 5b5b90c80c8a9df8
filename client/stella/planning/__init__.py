"""``stella plan`` and ``stella profile``: what a job will cost, how long it will take, and
on which machines. A tool shipped beside the library; the training path never imports it.

One concern a module, each importing only those above it in this list (``measure``
apart: it measures a model and writes a profile file):

- :mod:`~stella.planning.catalog` the catalog (TOML) of machine kinds and the server
  host, its schema check, and :class:`~stella.planning.catalog.PlanError`;
- :mod:`~stella.planning.profile_file` the profile (JSON) of a model: its format, its
  reading and writing, and what it answers (bytes, compressor time, iterations factor);
- :mod:`~stella.planning.model` the performance model: s/it, time to target, revocations
  and cost of a configuration (NumPy, vectorised over machine mixes and settings);
- :mod:`~stella.planning.search` every configuration of a catalog, ranked under a deadline
  and/or a budget, and the Pareto front;
- :mod:`~stella.planning.calibrate` the model's coefficients fitted on measured runs
  (``stella calibrate``; ``bench.plan`` on the test bed's);
- :mod:`~stella.planning.report` the table, the recommended settings, the JSON and the plot;
- :mod:`~stella.planning.measure` ``stella profile``'s measurements (torch, a real
  ``stella-ps`` on loopback, or a running job's status).

No module here but ``measure`` imports torch: ``stella plan`` answers without it. The
command line is :mod:`stella.cli`; the formats and the model are in docs/plan.md.
"""

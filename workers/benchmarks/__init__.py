"""The workers app's benchmarks, and the live-loop benchmarks' shared pieces.

``runtime``: the chunk engine's coalescing, offload and the model profile (``bench_runtime``,
``profile_model``); ``migration``: the state transport against a raw socket
(``python -m workers.benchmarks.migration``); ``ingest``: chunk records into PostgreSQL
(``bench_ingest``); ``delivery_publisher``: the worker's side of ``bench_delivery``; ``live``: the
benchmark database, service checks and child processes that ``bench_ingest``, ``bench_delivery`` and
``bench_activation`` share. Arguments, figures, the machine and JSON are :mod:`contracts.bench`'s.
"""

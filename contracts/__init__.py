"""What the apps agree on, written once: every app imports its contracts from here, never from
another app's internals.

- ``contracts.wire``: what crosses a process boundary between workers and the control plane, pure
  Python (no Django): the chunk frame codec and channel-layer message types (``frames``), the durable
  chunk-record stream (``records``), the per-worker command streams, heartbeats and publish fencing
  in Redis (``channel``), and where session checkpoints live (``checkpoints``).
- ``contracts.catalog``: the model presets (architecture shapes; pure Python, so the web process never
  imports torch), the catalogue users choose from, and local Wan2.1-family checkpoints registered
  as presets (``MODEL_PATHS``).
- ``contracts.coserve``: when a one-shot job step may run beside streams on one device (the slack
  the streams' next chunks leave): the rule the worker daemon runs and the simulator measures.
- ``contracts.http``: the shape every REST endpoint shares (error body, pagination, the audit
  endpoints' query parameters and CSV), and time ranges from query parameters (Django/DRF).
- ``contracts.health``: what a readiness check reports, and the checks of PostgreSQL and Redis.
- ``contracts.process``: processes that die with the platform that started them (the parent-death
  signal, the subreaper, ``python -m contracts.process -- ARGV``).
- ``contracts.bench``: the report every benchmark prints (arguments, warm-up, summaries, the machine,
  JSON out). Lab only: no service module imports it (``lint-imports``).
"""

"""The sessions app's benchmark: worker → client chunk delivery (the ``bench_delivery`` command).

``delivery`` runs it against a real ASGI server; ``delivery_clients`` is its clients' process (the
publisher's, the worker side, is ``workers.benchmarks.delivery_publisher``); ``fixed_dispatch`` is
the consumer variant it can compare.
"""

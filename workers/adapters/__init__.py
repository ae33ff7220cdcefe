"""The Django side of the worker's ports (``workers.ports``): the only modules of ``workers``, with
the management commands that wire them, that import the control plane.

``reporting`` — `DjangoReporter` (the daemon's ``Reporter``, a thread of control-plane writes) and
the scale-out phases of a starting worker; ``pool`` — `DjangoPoolLink` (the weights loader's
``PoolLink``) and `DjangoHostCacheLink` (the host cache's ``HostCacheLink``).
"""

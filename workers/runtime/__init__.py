"""The GPU worker runtime: streaming video models, the coalesced chunk engine, state offload.

Pure PyTorch: nothing under this package imports Django (the worker daemon wraps it).
"""

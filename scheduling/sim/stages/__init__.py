"""Stage-level serving in the lab (TridentServe, issue 15): ``simulator`` runs TridentServe and the
paper's baselines over a mixed trace with the placement and dispatch of ``scheduling.core.stages``;
``workloads`` generates the mixes; ``encoder_pool`` is the streams' memory model (sessions per GPU
with a shared text-encoder pool); ``cli`` is what ``simulate_stages`` calls."""

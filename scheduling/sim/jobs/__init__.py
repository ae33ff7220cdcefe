"""One-shot jobs in the lab (issue 14, GenServe): ``cosim`` runs them inside the stream simulator on
the GPUs the streams leave, with a round solver of ``scheduling.core.jobs.solver``; ``workload``
generates GenServe-shaped job submits."""

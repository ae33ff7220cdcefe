"""One-shot image and video jobs served beside the streams (issue 14, GenServe; issue 15, TridentServe).

Pure: no Django, no worker imports. The live dispatcher's contract is ``policy.JobPolicy``
(``JobRound`` in, ``JobPlan`` out) with its built-in policies: ``policy.EdfJobPolicy``,
``genserve.GenServeJobPolicy`` and ``tridentserve.TridentServeJobPolicy``; ``scheduling.live.jobs``
reads the rows, asks the ``JOB_POLICY`` for a plan and applies it. Beneath them: ``job_profiles``
costs a job step from measured points; ``solver`` is GenServe's round solver (Alg. 1) and its
baselines (``RoundSolver``, also the simulator's job policies); ``backlog`` is the autoscaler's job
demand. The co-simulation of jobs with the streams is the lab's (``scheduling.sim.jobs``).
"""

"""One-shot image and video jobs served beside the streams (issue 14, GenServe).

Pure: no Django, no worker imports. ``profiles`` costs a job step from measured points;
``solver`` is GenServe's round solver (Alg. 1) and the baselines; ``cosim`` runs jobs inside the
stream simulator on the GPUs the streams leave.
"""

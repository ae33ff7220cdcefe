"""Live stage placement: TridentServe's Alg. 2 and §5.3 trigger on the live pool (docs/stages.md,
"Live placement"), one module per job.

With ``STAGE_PLACEMENT=tridentserve`` every scheduler run calls ``stage_placement_step`` for its
model pool, inside the run's transaction with the pool's worker rows locked:

1. The placement being applied makes progress: a ``set_role`` left without an answer past the
   command timeout fails; then the next planned changes are sent, never more than
   ``STAGE_MAX_CHANGING`` workers changing role at once, so the pool never pauses as a whole (every
   other worker keeps serving in its role; the changing one loads or drops stages lazily).
2. With no placement in progress, the first run plans from the recent mix (``bootstrap``); later runs
   feed the §5.3 trigger with the stage ops completed in its window and re-plan when it fires. A plan
   whose role counts equal the current ones changes nothing and is not recorded.

The worker answers ``set_role`` through ``answers.command_answered`` → ``stage_change_answered``,
which records the outcome and asks for a tick, so the next change goes out without waiting for the
periodic one.

Sessions run where their diffusion model and decoder are: the snapshot the policy sees leaves out
workers without D and C (``GpuWorker.holds_sessions``), and a session on a worker without E gets the
encoder the pool chose for it (``encoder_for``) in its ``start`` and ``prompt`` commands.

The modules:

- ``placement``: ``stage_placement_step``, one step per scheduler run of a pool (the order above:
  changes in progress, the encoder pool, auxiliary workers the plan no longer needs, the §5.3
  trigger and a new plan);
- ``changes``: a placement's role changes — sent within ``STAGE_MAX_CHANGING``, settled by the
  worker's answer (``stage_change_answered``) or the command timeout, the placement finished;
- ``mix``: what a plan is made from (the recent jobs, the streams' chunks and prompt encodes) and the
  pool's state it needs (busy workers, a missing encoder), read from the rows;
- ``peers``: the encoder (E) or decoder (C) worker a worker whose role lacks that stage uses;
- ``encoders``: encoder failover for workers without E and the re-sending of prompts they refused;
- ``auxiliary``: the E and C workers — growing the encoder pool, re-placing an idle E or C worker the
  plan no longer needs, the role a newly provisioned worker gets.
"""

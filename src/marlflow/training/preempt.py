"""Preemption: a SIGTERM or SIGUSR1 stops training at a safe point, checkpointed, with exit code 75 for a rerun.

SLURM sends SIGUSR1 `--signal=USR1@N` seconds before a job's time limit (profiles/slurm asks for it on the train
rule) and SIGTERM on scancel, on preemption and at the time limit itself; Snakemake's local executor sends
SIGTERM to its jobs when it is stopped. `install()` (marlflow.cli.train's main calls it) makes the first SIGTERM or
SIGUSR1 a request that the trainer reads at its safe points (marlflow.training.trainer `_fit` and `train_step`):

- before a step's update has started (during its rollout): the step is abandoned. The Python, NumPy, torch and
  CUDA RNG states and the rollout engine's stored K/V go back to what they were at the step's start, so the
  rerun does that step exactly as an uninterrupted run does. A rollout stops at its next stage
  (`marlflow.workflows.Context.should_stop`), not at the end of the rollout.
- during or after the update: the step is finished, its evaluation included when one is due. A chunked
  evaluation (RunConfig.eval_chunk_problems > 0) stops before its next chunk instead: the step's checkpoint
  keeps the finished chunks' episodes (marlflow.training.evaluation.Partial), and the rerun evaluates the rest
  before its next step, so the run ends as an uninterrupted one does (tests/test_mid_eval.py).

Then the last completed step is checkpointed (unless that very checkpoint is already on disk; a deferred step-0
evaluation is filled in first, so the checkpoint holds step 0's rows), one line is logged (the signal, the step
checkpointed, "steps lost: 0"), and the process exits with EXIT_PREEMPTED = 75 (EX_TEMPFAIL in sysexits.h:
"try again later"). Snakemake counts the job as failed and resubmits it (`retries`), and the rerun resumes from
that checkpoint: no step is lost and none is done twice (tests/test_resume.py). A signal that arrives before the
first step starts leaves nothing to checkpoint: the rerun starts again from step 0, whose evaluation it reads
from the cell's shared cache (marlflow.training.base_eval). A signal during the last step lets the run finish normally,
unless it stops a chunked evaluation.

A second SIGTERM or SIGUSR1 exits at once with 128 + the signal's number (143 / 138), as every SIGTERM did
before: SLURM's SIGTERM at the time limit follows its SIGUSR1 (and SIGKILL follows KillWait seconds later),
and a user who signals twice wants the process gone (the same signal again within REPEAT_S = 5 s is taken as
one delivered twice, as SLURM does to the ranks of an N-rank run, and ignored). Stopping anywhere leaves the
newest complete checkpoint loadable (marlflow.training.checkpoint writes each whole or not at all). SIGINT (Ctrl-C) is left to Python: an immediate
KeyboardInterrupt.

Data-parallel runs (marlflow.training.distributed): the ranks decide together (`distributed.stop_agreed`), so a signal
to any one rank stops every rank after the same step; rank 0 alone writes the checkpoint, and every rank exits with 75.
"""

from __future__ import annotations

import signal
import sys
import time

EXIT_PREEMPTED = 75  # EX_TEMPFAIL: the run stopped on a signal, checkpointed; rerun it to resume
SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
# The same signal again within this many seconds is the first one delivered twice, not a second request: SLURM
# sends a job's signal to every process of its steps, so each rank of an N-rank run gets it from slurmd and once
# more from the srun that started it, which forwards SIGUSR1 to its tasks (1 ms apart on the CI cluster).
REPEAT_S = 5.0

_requested: tuple[int, float] | None = None  # (signal number, time.time() it arrived)


class Preempted(Exception):
    """Training stopped on a signal after checkpointing its last completed step (marlflow.cli.train exits with
    EXIT_PREEMPTED)."""


def install() -> None:
    """Handle SIGTERM and SIGUSR1 as described in the module docstring, from no request. Call from the main
    thread."""
    reset()
    for s in SIGNALS:
        signal.signal(s, _handler)


def _handler(signum, frame) -> None:
    # Only record: the trainer acts at its next safe point. Nothing here logs or allocates much, because a
    # handler runs between two bytecodes of whatever the main thread was doing.
    global _requested
    if _requested is not None:
        if signum == _requested[0] and time.time() - _requested[1] < REPEAT_S:
            return  # the same request delivered twice (SLURM's --signal reaches a rank directly and through srun)
        sys.exit(128 + signum)
    _requested = (signum, time.time())


def requested() -> bool:
    """Whether a stop was requested (a SIGTERM or SIGUSR1 arrived since `install` or `reset`)."""
    return _requested is not None


def describe() -> str:
    """The request for the log: 'SIGUSR1 (received 12.3 s ago)'; '' when there is none."""
    if _requested is None:
        return ""
    signum, at = _requested
    return f"{signal.Signals(signum).name} (received {time.time() - at:.1f} s ago)"


def reset() -> None:
    """Forget a request (`install` does; for in-process tests)."""
    global _requested
    _requested = None

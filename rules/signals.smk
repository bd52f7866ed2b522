# SIGUSR1 is ignored by Snakemake itself, so that SLURM's `--signal=USR1@900` (profiles/slurm, train rule) stops
# the trainer and not the Snakemake that runs it.
#
# Inside a SLURM job, snakemake-executor-plugin-slurm runs a Snakemake in the batch script, which starts the
# job with `srun` (snakemake-executor-plugin-slurm-jobstep); that srun step runs a second Snakemake, which runs
# the rule's `bash -c` shell, which runs `python -m marlflow train`. `--signal=USR1@N` (no `B:`) signals every
# process of the job's steps, not the batch script: that second Snakemake, bash and the trainer. Python's and
# bash's default for SIGUSR1 is to terminate: Snakemake would die at once, its srun step would end, and SLURM
# would kill the trainer before its checkpoint. Set to "ignore" here, while this file is read (every Snakemake,
# the job's own included, reads it before it runs any job), it is inherited by the rule's shell, which then
# survives too, and the trainer installs its own handler (marlflow.training.preempt): it finishes or abandons its step,
# checkpoints and exits 75, and Snakemake's `retries` resubmits it. Checked on a single-node SLURM with the
# same plugins (docs/environment.md, "Preemption").
import signal as _signal
import threading as _threading

if _threading.current_thread() is _threading.main_thread():
    _signal.signal(_signal.SIGUSR1, _signal.SIG_IGN)

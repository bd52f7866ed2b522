"""Data-parallel plumbing of one run (issue 27): which rank this process is, the process group, the work split,
and the collectives the trainer needs. Small on purpose (nanoGPT-style): torch.distributed does the work.

A run with `ranks: N` (RunConfig) is N processes. `python -m marlflow train` starts them itself (`launch_argv`):
`torchrun --standalone --nproc-per-node N` on one machine, `srun --ntasks N` inside a SLURM allocation (the
train rule asks for N tasks, profiles/slurm). Each process then calls `init(device)`, which reads its rank from
the environment (`from_environ`: torchrun's RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT, or
srun's SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID / SLURM_STEP_NODELIST with the rendezvous address derived
from them) and joins a gloo (CPU) or NCCL (CUDA) process group. A single process (no such variables, or a
world of 1) needs no group: every collective below is then the identity, so the trainer has one code path.

    env = distributed.init("cpu")                    # Env(rank=0, world=1, ...) when run alone
    mine = distributed.shard(problems, env.rank, env.world)   # whole problems: a GRPO group stays on one rank
    flat = distributed.all_reduce_mean(local_sum_grad, local_count)   # == the 1-rank gradient
    outcomes = distributed.gather_shards(local_outcomes)        # every rank's, in the order of `problems`
    if distributed.is_main(): write(...)

Failures: a rank that dies (SIGKILL, OOM) must end the job, not leave the others waiting in a collective.
torchrun and `srun --kill-on-bad-exit=1` stop the other ranks when one exits badly; under them and on their
own, every collective has a timeout (`init(timeout_s=...)`, COLLECTIVE_TIMEOUT_S by default) after which it
raises instead of blocking. gloo also fails at once when a peer's connection closes; NCCL aborts the process
at the timeout (TORCH_NCCL_ASYNC_ERROR_HANDLING=1, set here unless the environment sets it).
tests/test_distributed.py runs 2 real gloo processes for each of these.
"""

from __future__ import annotations

import datetime
import os
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from marlflow.training import (
    preempt,  # A collective waits this long for the slowest rank before it raises. It must outlast the longest time one rank
)

# may legitimately spend alone between two collectives: rank 0 writing a checkpoint of a 4B model's adapters
# and AdamW moments while the others wait at the next step (seconds to minutes), or one rank's uneven share of
# a rollout. 30 minutes is torch's own default for gloo; a dead peer is usually noticed far sooner (a closed
# connection under gloo; the launcher's own kill under torchrun and srun).
COLLECTIVE_TIMEOUT_S = 1800.0
# The rendezvous port derived from a SLURM job id when MASTER_PORT is not set: 20000 + id mod 10000, a range
# clear of the usual ephemeral ports (32768+) and of well-known services; two jobs on one node collide only if
# their ids differ by a multiple of 10000 (set MASTER_PORT then).
PORT_BASE, PORT_SPAN = 20000, 10000


@dataclass(frozen=True)
class Env:
    """Where this process stands in the run: rank in 0..world-1, local_rank on its node (the GPU it uses), the
    rendezvous address and port, and source: "single" (no launcher), "torchrun" or "slurm"."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    source: str = "single"


class DistributedError(RuntimeError):
    """A launch environment that cannot work; the message names the variable and the fix."""


def first_host(nodelist: str) -> str:
    """The first host of a SLURM hostlist ("gpu[03-05,9],cpu1" -> "gpu03"; "a,b" -> "a"): rank 0's node,
    where the rendezvous runs (SLURM places task 0 on the first node of the step)."""
    head = re.match(r"[^,\[]*(\[[^\]]*\])?", nodelist.strip())
    part = head.group(0) if head else ""
    if not part:
        raise DistributedError(
            f"SLURM nodelist {nodelist!r} is empty or malformed; expected e.g. 'gpu[01-04]'"
        )
    if "[" not in part:
        return part
    prefix, ranges = part[: part.index("[")], part[part.index("[") + 1 : -1]
    return prefix + ranges.split(",")[0].split("-")[0]  # keeps the zero padding: gpu[03-05] -> gpu03


def slurm_port(job_id: str) -> int:
    """The rendezvous port of a SLURM job: PORT_BASE + job_id mod PORT_SPAN (the same on every rank)."""
    digits = re.sub(r"\D", "", job_id)
    return PORT_BASE + (int(digits) % PORT_SPAN if digits else 0)


def _int(environ: Mapping[str, str], name: str) -> int:
    value = environ[name]
    try:
        return int(value)
    except ValueError:
        raise DistributedError(f"environment variable {name}={value!r} is not an integer") from None


def from_environ(environ: Mapping[str, str]) -> Env:
    """This process's Env from launcher variables (pure: `environ` is a mapping such as os.environ).

    torchrun sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT. Inside an srun step (SLURM_STEP_ID
    set: a batch script has SLURM_PROCID 0 and the job's SLURM_NTASKS too, but no step, and is not a rank),
    the rank is SLURM_PROCID of SLURM_NTASKS, LOCAL_RANK SLURM_LOCALID; MASTER_ADDR defaults to the step's
    first node and MASTER_PORT to `slurm_port(SLURM_JOB_ID)`. Anything else is a single process."""
    if "RANK" in environ and "WORLD_SIZE" in environ:
        rank, world = _int(environ, "RANK"), _int(environ, "WORLD_SIZE")
        local = _int(environ, "LOCAL_RANK") if "LOCAL_RANK" in environ else rank
        addr = environ.get("MASTER_ADDR", "127.0.0.1")
        port = _int(environ, "MASTER_PORT") if "MASTER_PORT" in environ else 29500
        source = "torchrun"
    elif "SLURM_STEP_ID" in environ and "SLURM_PROCID" in environ and "SLURM_NTASKS" in environ:
        rank, world = _int(environ, "SLURM_PROCID"), _int(environ, "SLURM_NTASKS")
        local = _int(environ, "SLURM_LOCALID") if "SLURM_LOCALID" in environ else 0
        nodes = environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST") or environ.get(
            "SLURM_NODELIST", "")  # fmt: skip
        addr = environ.get("MASTER_ADDR") or first_host(nodes)
        port = (_int(environ, "MASTER_PORT") if "MASTER_PORT" in environ
                else slurm_port(environ.get("SLURM_JOB_ID", "")))  # fmt: skip
        source = "slurm"
    else:
        return Env()
    if world < 1 or not 0 <= rank < world or local < 0:
        raise DistributedError(f"rank {rank} of world {world} (local rank {local}, from {source}) is impossible: "
                               "a launcher sets 0 <= rank < world; check the job's environment")  # fmt: skip
    if world == 1:
        return Env()
    return Env(rank, world, local, addr, port, source)


def backend_for(device: str) -> str:
    """The process-group backend for a run's device: NCCL on CUDA GPUs, gloo on CPUs."""
    return "nccl" if device == "cuda" else "gloo"


_ENV = Env()  # this process's place, set by init()


def init(
    device: str, timeout_s: float = COLLECTIVE_TIMEOUT_S, environ: Mapping[str, str] | None = None
) -> Env:
    """Join the run's process group (a no-op for a single process) and return this process's Env.

    device: the run's device ("cpu", "cuda"); a CUDA rank uses GPU `local_rank`. timeout_s: how long any
    collective waits for the other ranks before it raises (a dead or stuck rank ends the job)."""
    global _ENV
    env = from_environ(os.environ if environ is None else environ)
    if env.world == 1:
        _ENV = env
        return env
    if device == "cuda":
        if torch.cuda.device_count() <= env.local_rank:
            raise DistributedError(f"rank {env.rank} has local rank {env.local_rank} but this node shows "
                                   f"{torch.cuda.device_count()} GPU(s): give each rank its own GPU (srun "
                                   "--gpus-per-task 1, or torchrun --nproc-per-node <= GPUs)")  # fmt: skip
        torch.cuda.set_device(env.local_rank)
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")  # abort at the timeout, do not hang
    # torchrun already serves the rendezvous store on MASTER_PORT (its agent's store): join it through env://.
    # Under srun nobody does: rank 0 opens it at the derived address.
    method = "env://" if env.source == "torchrun" else f"tcp://{env.master_addr}:{env.master_port}"
    dist.init_process_group(backend=backend_for(device), init_method=method, rank=env.rank, world_size=env.world,
                            timeout=datetime.timedelta(seconds=timeout_s))  # fmt: skip
    _ENV = env
    return env


def close() -> None:
    """Leave the process group (if any); the process is a single one afterwards.

    A colocated vLLM engine (backend vllm, marlflow.generation.vllm) builds its own groups on top of this one, and
    its shutdown at interpreter exit destroys them and then the default group; destroying the default group
    first makes that shutdown raise ("Invalid process group specified") in every rank's log. While vLLM's groups
    exist, the group is left to it."""
    global _ENV
    vllm_groups = sys.modules.get("vllm.distributed.parallel_state")
    if vllm_groups is not None and vllm_groups.model_parallel_is_initialized():
        _ENV = Env()
        return
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    _ENV = Env()


def rank() -> int:
    return _ENV.rank


def world() -> int:
    return _ENV.world


def is_main() -> bool:
    """Whether this process writes the run's files (metrics, samples, checkpoints, DONE): rank 0 only."""
    return _ENV.rank == 0


def _grouped() -> bool:
    return _ENV.world > 1 and dist.is_initialized()


def shard_bounds(n: int, rank: int, world: int) -> tuple[int, int]:
    """[start, stop) of rank's share of n items: contiguous blocks whose sizes differ by at most one, the first
    n mod world ranks one larger. Concatenating the blocks in rank order gives 0..n-1 back."""
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"rank {rank} of world {world}: need world >= 1 and 0 <= rank < world")
    base, extra = divmod(n, world)
    start = rank * base + min(rank, extra)
    return start, start + base + (rank < extra)


def shard(items: Sequence, rank: int, world: int) -> list:
    """Rank's share of `items` (a step's problems, an evaluation's problems): a pure function of (items, rank,
    world). Whole items go to one rank, so every rollout of a problem, i.e. its GRPO group, is on one rank and
    advantages need no communication. Empty when there are fewer items than ranks."""
    start, stop = shard_bounds(len(items), rank, world)
    return list(items[start:stop])


def all_reduce_sum(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Element-wise sum of each tensor over the ranks, in one collective (the tensors are packed into one fp32
    buffer). Shapes and order must agree on every rank. Returns new tensors; a single process returns copies."""
    if not _grouped():
        return [t.detach().clone() for t in tensors]
    flat = torch.cat([t.detach().reshape(-1).to(torch.float32) for t in tensors])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    out, at = [], 0
    for t in tensors:
        out.append(flat[at : at + t.numel()].view(t.shape).to(t.dtype))
        at += t.numel()
    return out


def all_reduce_mean(local_sum: torch.Tensor, local_count: float) -> torch.Tensor:
    """(sum over ranks of local_sum) / (sum over ranks of local_count).

    local_sum: [P] a rank's gradient summed over its items (not averaged), local_count: how many items (calls,
    tokens: whatever the loss averages over) it holds. The result is the mean over all items, which is the
    1-rank gradient whatever the split, also when ranks hold unequal shares (an uneven last shard, an empty
    one with count 0). One collective: the count travels in the same buffer."""
    buf = torch.cat([local_sum.detach().reshape(-1).to(torch.float32),
                     torch.tensor([float(local_count)], device=local_sum.device)])  # fmt: skip
    (total,) = all_reduce_sum([buf])
    count = float(total[-1])
    if count <= 0:
        raise ValueError("all_reduce_mean: no rank holds any item (total count 0); nothing to average")
    return (total[:-1] / count).view(local_sum.shape).to(local_sum.dtype)


def gather(obj) -> list:
    """Every rank's `obj` (picklable), in rank order, on every rank; [obj] for a single process."""
    if not _grouped():
        return [obj]
    out = [None] * _ENV.world
    dist.all_gather_object(out, obj)
    return out


def gather_shards(local: Sequence) -> list:
    """The concatenation of every rank's list in rank order: with `shard`, the full list in its original order
    (an evaluation's outcomes, one per problem, as one process would have produced them)."""
    return [x for part in gather(list(local)) for x in part]


def from_main(fn):
    """fn() run on rank 0 alone, its result (picklable) returned on every rank: a decision that reads or
    changes the run's files (which checkpoint to resume from, a shared cache entry) made once for all ranks.
    A single process returns fn() itself."""
    return gather(fn() if is_main() else None)[0]


def any_rank(flag: bool) -> bool:
    """Whether `flag` is true on any rank (one all-reduce; the flag itself for a single process): ranks that
    each saw a signal or not agree on one answer at the same point of the step."""
    if not _grouped():
        return bool(flag)
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"  # NCCL reduces CUDA tensors only
    (total,) = all_reduce_sum([torch.tensor([float(bool(flag))], device=device)])
    return bool(total.item() > 0)


def stop_agreed() -> bool:
    """Whether a stop was requested (marlflow.training.preempt) on any rank of the run (`preempt.requested()` for a single
    process). A signal may reach one rank only, or each at another time; every rank calls this at the same points
    (marlflow.training.trainer: before a step's update and at each step boundary), so all stop after the same step."""
    return any_rank(preempt.requested())


def barrier() -> None:
    if _grouped():
        dist.barrier()


def launch_argv(ranks: int, argv: Sequence[str], environ: Mapping[str, str], device: str = "cpu",
                threads: int = 1) -> list[str] | None:  # fmt: skip
    """The command that starts `ranks` ranks of `python -m marlflow train argv`, or None when this process is
    to train itself (ranks 1, or already one of the ranks). Pure, for tests.

    Inside a SLURM job (SLURM_JOB_ID set; the train rule's job asked for `ranks` tasks) it is `srun --ntasks
    ranks --kill-on-bad-exit=1 ...`: SLURM places the tasks, on several nodes when the job spans them, and
    ends the step when one task fails. Elsewhere it is `torchrun --standalone --nproc-per-node ranks`: one
    machine, a private rendezvous on a free port, and every rank stopped when one fails."""
    here = from_environ(environ)
    if ranks <= 1 or here.world > 1:
        if here.world > 1 and here.world != ranks:
            raise DistributedError(f"this process is rank {here.rank} of {here.world} ({here.source}), but the run "
                                   f"config sets ranks {ranks}: start it with {ranks} ranks, or set ranks: "
                                   f"{here.world}")  # fmt: skip
        return None
    cmd = [sys.executable, "-m", "marlflow.cli.train", *argv]
    if environ.get("SLURM_JOB_ID"):
        # --overlap: Snakemake's SLURM executor runs the rule inside a one-task step (`srun -n1`) that holds the
        # job's CPUs and GPUs; the ranks' step must share them with it (the waiting launcher uses none).
        srun = [
            "srun",
            f"--ntasks={ranks}",
            "--overlap",
            "--kill-on-bad-exit=1",
            f"--cpus-per-task={threads}",
        ]
        if device == "cuda":
            srun.append("--gpus-per-task=1")
        return [*srun, *cmd]
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable)) or "torchrun"
    # torchrun passes SIGTERM, SIGINT and SIGUSR1 (not among its defaults) on to the ranks, and gives them
    # STOP_GRACE_S to checkpoint before it SIGKILLs them (its own default is 30 s).
    return [torchrun, "--standalone", f"--nproc-per-node={ranks}", f"--signals-to-handle={TORCHRUN_SIGNALS}",
            f"--shutdown-timeout={STOP_GRACE_S}", "-m", "marlflow.cli.train", *argv]  # fmt: skip


# What the ranks' srun may inherit from the launching step: the job's identity. The step's own settings
# (SLURM_NTASKS=1, its CPUs and GPUs, SLURM_STEP_*) would otherwise be read by srun as defaults that conflict
# with the ranks' step (the same list Snakemake's SLURM executor keeps for its own nested srun).
SLURM_KEEP = ("SLURM_JOB_ID", "SLURM_JOBID", "SLURM_CLUSTER_NAME", "SLURM_SUBMIT_DIR", "SLURM_SUBMIT_HOST",
              "SLURM_CONF")  # fmt: skip


def launch_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The environment for `launch_argv`'s command: `environ` without the launching step's SLURM_* / SRUN_* /
    SBATCH_* settings (SLURM_KEEP stays) and without a previous launcher's rank variables."""
    drop = (
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "GROUP_RANK",
        "MASTER_ADDR",
        "MASTER_PORT",
    )
    return {k: v for k, v in environ.items()
            if k in SLURM_KEEP or not (k.startswith(("SLURM_", "SRUN_", "SBATCH_")) or k in drop)}  # fmt: skip


# ---------------------------------------------------------------------------------------------- the launcher

# How long torchrun lets the ranks of a stopped run finish their step and checkpoint before it SIGKILLs them: the
# budget profiles/slurm gives one rank before the time limit (--signal=USR1@900). A rank that dies also gets the
# others this SIGTERM first; under gloo they fail at once anyway (a peer's closed connection).
STOP_GRACE_S = 900
TORCHRUN_SIGNALS = "SIGTERM,SIGINT,SIGUSR1"
FORWARDED = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
# The file rank 0 writes when the run stopped on a signal after checkpointing (set by `launch` for its ranks).
PREEMPTED_FILE_ENV = "MARLFLOW_PREEMPTED_FILE"


def launch_exit_code(returncode: int, preempted: bool) -> int:
    """The exit code of an N-rank run from its launcher's (torchrun's or srun's) and whether rank 0 reported a
    stop on a signal with its last completed step checkpointed (`report_preempted`). Pure.

    returncode: the launcher's exit status, negative -N when a signal N killed it (subprocess's convention).
    0 stays 0. Otherwise 75 (preempt.EXIT_PREEMPTED: rerun to resume, nothing lost) when rank 0 reported, since
    neither launcher keeps a rank's 75: torchrun exits 1 when any rank fails, srun with the highest code of its
    tasks, 137 once --kill-on-bad-exit has killed the rest. Else the launcher's own code, 128 + N for a signal."""
    if returncode == 0:
        return 0
    if preempted:
        return preempt.EXIT_PREEMPTED
    return 128 - returncode if returncode < 0 else returncode


def report_preempted(environ: Mapping[str, str] | None = None) -> None:
    """Called by every rank that stopped on a signal (marlflow.cli.train, on preempt.Preempted): rank 0 writes the
    launcher's file ($MARLFLOW_PREEMPTED_FILE, JSON), then all ranks meet at a barrier, so none exits before the
    file exists (torchrun and srun end the others as soon as one rank exits non-zero). Nothing to do without a
    launcher (a 1-rank run exits 75 itself); a barrier that fails (a dead peer) is not waited for."""
    path = (os.environ if environ is None else environ).get(PREEMPTED_FILE_ENV)
    if not path:
        return
    if is_main():
        from marlflow.store.atomic import atomic_write_json

        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        atomic_write_json(path, {"rank": rank(), "world": world(), "signal": preempt.describe()})
    try:
        barrier()
    except Exception as err:  # any collective failure: the peer is gone, nothing to wait for
        print(
            f"marlflow train: rank {rank()}: barrier after the stop failed ({err}); exiting", file=sys.stderr
        )


def launch(cmd: Sequence[str], environ: Mapping[str, str], preempted_file: str | os.PathLike) -> int:
    """Run `cmd` (launch_argv's torchrun or srun command) and return the run's exit code (launch_exit_code).

    Signals: under torchrun, SIGTERM, SIGUSR1 and SIGINT sent to this process are passed to torchrun (started
    in its own session, so a signal to this process group reaches it once), which passes them to the ranks.
    Under srun nothing is passed on: SLURM signals every process of the job's steps itself (srun and each rank
    get scancel's and --signal's signal directly; srun also forwards a SIGUSR1 to its tasks, which
    marlflow.training.preempt takes as the same request), and a SIGTERM to srun makes it SIGKILL its tasks at once.
    The launcher itself only waits. preempted_file: where rank 0 reports a stop (removed before and after)."""
    target = Path(preempted_file)
    target.unlink(missing_ok=True)
    slurm = os.path.basename(cmd[0]) == "srun"
    child: list[subprocess.Popen] = []
    pending: list[int] = []

    def forward(signum, frame):
        print(f"marlflow train: launcher got {signal.Signals(signum).name}"
              + ("" if slurm else ", passed to torchrun"), file=sys.stderr, flush=True)  # fmt: skip
        if slurm:
            return
        if child:
            child[0].send_signal(signum)
        else:
            pending.append(signum)

    before = {s: signal.signal(s, forward) for s in FORWARDED}
    try:
        env = {**launch_env(environ), PREEMPTED_FILE_ENV: str(target)}
        child.append(subprocess.Popen(list(cmd), env=env, start_new_session=not slurm))
        for s in pending:
            child[0].send_signal(s)
        code = child[0].wait()
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)
    preempted = target.exists()
    target.unlink(missing_ok=True)
    return launch_exit_code(code, preempted)

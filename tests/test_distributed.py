"""marlflow.training.distributed: the pure helpers on toy tensors, and the collectives with 2 real gloo processes on the
CPU (started by torchrun, or with srun's environment variables set by hand), including a rank killed with
SIGKILL and a rank that stops answering: the survivor must fail within seconds, not hang.

This file is also the worker those processes run: `python tests/test_distributed.py MODE OUT_DIR`.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from marlflow.pipeline import snake
from marlflow.training import distributed as D
from marlflow.training import preempt

HERE = Path(__file__).resolve()
ROOT = HERE.parents[1]


# ------------------------------------------------------------------------------------------------ pure helpers


@pytest.mark.parametrize(
    "nodelist, host",
    [
        ("gpu[03-05,9],cpu1", "gpu03"),
        ("a,b", "a"),
        ("node7", "node7"),
        ("n[1,4]", "n1"),
        ("x-[10-11]", "x-10"),
    ],
)
def test_first_host(nodelist, host):
    assert D.first_host(nodelist) == host


def test_first_host_empty_is_an_error():
    with pytest.raises(D.DistributedError, match="nodelist"):
        D.first_host("")


def test_slurm_port_is_the_same_for_every_rank_of_a_job_and_in_range():
    assert D.slurm_port("123456") == D.slurm_port("123456") == D.PORT_BASE + 3456
    assert D.slurm_port("123456") != D.slurm_port("123457")
    assert D.PORT_BASE <= D.slurm_port("99999999") < D.PORT_BASE + D.PORT_SPAN


def test_from_environ():
    assert D.from_environ({}) == D.Env()
    tr = {"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_ADDR": "h0", "MASTER_PORT": "1234"}
    assert D.from_environ(tr) == D.Env(1, 4, 1, "h0", 1234, "torchrun")
    step = {"SLURM_STEP_ID": "0", "SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1",
            "SLURM_STEP_NODELIST": "gpu[07-08]", "SLURM_JOB_ID": "4242"}  # fmt: skip
    assert D.from_environ(step) == D.Env(3, 4, 1, "gpu07", D.slurm_port("4242"), "slurm")
    assert D.from_environ({**step, "MASTER_ADDR": "m", "MASTER_PORT": "99"}).master_port == 99
    # A batch script has the job's task count and PROCID 0 but no step: it is not a rank (it launches them).
    batch = {k: v for k, v in step.items() if k != "SLURM_STEP_ID"}
    assert D.from_environ(batch) == D.Env()
    assert D.from_environ({**tr, "WORLD_SIZE": "1", "RANK": "0"}) == D.Env()  # a world of one: no group
    with pytest.raises(D.DistributedError, match="impossible"):
        D.from_environ({**tr, "RANK": "4"})
    with pytest.raises(D.DistributedError, match="RANK='x'"):
        D.from_environ({**tr, "RANK": "x"})


def test_backend_for():
    assert D.backend_for("cuda") == "nccl" and D.backend_for("cpu") == "gloo"


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_shard_partitions_in_order_and_is_pure(world):
    for n in range(0, 11):
        items = [f"p{i}" for i in range(n)]
        parts = [D.shard(items, r, world) for r in range(world)]
        assert [x for p in parts for x in p] == items  # disjoint, complete, in order
        sizes = [len(p) for p in parts]
        assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)
        assert parts == [D.shard(list(items), r, world) for r in range(world)]  # same answer every time


def test_shard_keeps_a_problems_group_on_one_rank():
    problems = list(range(7))
    episodes = [(p, g) for p in problems for g in range(4)]  # G = 4 rollouts of each problem
    owner = {p: r for r in range(3) for p in D.shard(problems, r, 3)}
    for r in range(3):
        mine = set(D.shard(problems, r, 3))
        assert {p for p, _ in episodes if owner[p] == r} == mine


def test_shard_rejects_a_rank_outside_the_world():
    with pytest.raises(ValueError, match="rank 2 of world 2"):
        D.shard([1, 2], 2, 2)


def test_single_process_collectives_are_the_identity():
    g = torch.tensor([[1.0, -2.0], [3.0, 4.0]])
    assert torch.equal(D.all_reduce_mean(g * 4, 4), g)
    a, b = D.all_reduce_sum([g, torch.ones(3)])
    assert torch.equal(a, g) and torch.equal(b, torch.ones(3)) and a.data_ptr() != g.data_ptr()
    assert D.gather({"x": 1}) == [{"x": 1}] and D.gather_shards([1, 2]) == [1, 2]
    assert D.is_main() and D.world() == 1
    with pytest.raises(ValueError, match="count 0"):
        D.all_reduce_mean(torch.zeros(2), 0)


def test_launch_argv():
    argv = ["--config", "c.json", "--out", "r"]
    assert D.launch_argv(1, argv, {}) is None
    cmd = D.launch_argv(2, argv, {})
    assert cmd[1:3] == ["--standalone", "--nproc-per-node=2"]
    assert cmd[3:7] == ["--signals-to-handle=SIGTERM,SIGINT,SIGUSR1", f"--shutdown-timeout={D.STOP_GRACE_S}",
                        "-m", "marlflow.cli.train"] and cmd[7:] == argv  # fmt: skip
    cmd = D.launch_argv(4, argv, {"SLURM_JOB_ID": "7"}, device="cuda", threads=8)
    assert cmd[:6] == ["srun", "--ntasks=4", "--overlap", "--kill-on-bad-exit=1", "--cpus-per-task=8",
                       "--gpus-per-task=1"]  # fmt: skip
    assert cmd[6:] == [sys.executable, "-m", "marlflow.cli.train", *argv]
    rank = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "1"}
    assert D.launch_argv(2, argv, rank) is None  # already a rank: train
    with pytest.raises(D.DistributedError, match="ranks 4"):
        D.launch_argv(4, argv, rank)


def test_launch_env_keeps_the_job_and_drops_the_launching_steps_settings():
    env = {"SLURM_JOB_ID": "7", "SLURM_NTASKS": "1", "SLURM_STEP_ID": "0", "SLURM_CPUS_PER_TASK": "2",
           "SRUN_CPUS_PER_TASK": "2", "SBATCH_GPUS": "1", "RANK": "0", "PATH": "/bin", "HOME": "/h"}  # fmt: skip
    assert D.launch_env(env) == {"SLURM_JOB_ID": "7", "PATH": "/bin", "HOME": "/h"}


def _cfg(workflow="single", sharing="sp", model="results/models/toy", grpo=(), **run):
    """A toy run config: the planner-free defaults of a 2-step run; grpo None: small update-test settings."""
    from marlflow.core.config import GRPOParams, RunConfig, TaskSpec

    g = dict(steps=2, eval_every=1, problems_per_step=4)
    if run.get("ranks", 1) > 1:  # several ranks sample a 1-rank run's episodes only with per-call seeds
        run.setdefault("sampling_seeds", "per_call")
    if grpo is None:
        g.update(group_size=4, learning_rate=1e-2, warmup_steps=0, lr_scheduler="constant",
                 temperature=1.0, max_completion_length=24, max_prompt_length=256, lora_r=4, lora_alpha=8)  # fmt: skip
    return RunConfig(run_id=f"{workflow}-{sharing}-toy-math-s0", workflow=workflow, sharing=sharing, scale="toy",
                     task_axis="math", seed=0, task=TaskSpec(name="toy_math", eval_size=6, train_size=50),
                     model=model, grpo=GRPOParams(**g), generation_dtype="model", **run)  # fmt: skip


def test_config_ranks():
    from marlflow.core.config import ConfigError, RunConfig, config_fingerprint

    assert _cfg().ranks == 1 and "ranks" not in _cfg().to_dict()  # config.json of 1-rank runs is unchanged
    two = _cfg(ranks=2)
    assert two.to_dict()["ranks"] == 2 and RunConfig.from_dict(two.to_dict()) == two
    # Part of the training identity; a checkpoint that differs in ranks alone is resumed from all the same with
    # per-call seeds (marlflow.training.checkpoint.rank_change_refusal; tests/test_dp_train.py).
    assert config_fingerprint(two.to_dict()) != config_fingerprint(_cfg().to_dict())
    with pytest.raises(ConfigError, match="ranks is 5 but grpo.problems_per_step is 4"):
        _cfg(ranks=5)
    with pytest.raises(ConfigError, match="ranks 2 needs an explicit device"):
        _cfg(ranks=2, device="auto")
    with pytest.raises(ConfigError, match="ranks is 0; it must be >= 1"):
        _cfg(ranks=0)


def test_ranks_from_matrix_yaml_to_the_run_sheet():
    """`run: {ranks: N}` in a preset reaches each run's config (and so the train rule's tasks); an impossible N
    is refused with the field's message, like any run setting."""
    import yaml

    from marlflow.pipeline.matrix import MatrixError, run_sheet

    doc = yaml.safe_load((ROOT / "matrix.yaml").read_text())
    doc["presets"]["smoke"]["run"] = {"ranks": 2, "sampling_seeds": "per_call"}
    sheet = run_sheet(doc, "smoke")
    assert {snake.run_ranks(sheet, r) for r in sheet.index} == {2}
    assert {snake.run_ranks(run_sheet(yaml.safe_load((ROOT / "matrix.yaml").read_text()), "smoke"), r)
            for r in sheet.index} == {1}  # fmt: skip
    doc["presets"]["smoke"]["run"] = {"ranks": 3}  # smoke has 2 problems per step
    with pytest.raises(MatrixError, match="ranks is 3 but grpo.problems_per_step is 2"):
        run_sheet(doc, "smoke")


def test_ranks_gpu_refusal_and_run_ranks():
    import pandas as pd

    def row(ranks, device):
        cfg = {**_cfg(ranks=ranks).to_dict(), "device": device}
        return {"scale": "toy", "preset": "toy", "config": json.dumps(cfg)}

    sheet = pd.DataFrame({"a": row(1, "cpu"), "b": row(2, "cpu"), "c": row(2, "cuda")}).T
    assert [snake.run_ranks(sheet, r) for r in "abc"] == [1, 2, 2]
    assert snake.ranks_gpu_refusal(sheet, None) is None  # no GPUs in the profile (local runs)
    assert snake.ranks_gpu_refusal(sheet, {"toy": {"gpu": 2}}) is None  # CPU runs need no GPU each
    msg = snake.ranks_gpu_refusal(sheet, {"toy": {"gpu": 1}})
    assert msg.startswith("run c has ranks 2") and "scale_resources.toy.gpu" in msg


# ------------------------------------------------------------------------------------------------ 2 real ranks

N_ITEMS, P = 5, 6  # 5 items over 2 ranks: an uneven split (3 + 2)


def item_grad(i: int) -> torch.Tensor:
    """A toy per-item gradient [P] with values that do not sum exactly in fp32 in every order."""
    return torch.sin(torch.arange(P, dtype=torch.float32) * (i + 1) + 0.1 * i) * (1 + i) / 3


def worker(mode: str, out: Path) -> int:
    """One rank of a 2-rank run (see the tests below); writes OUT/rank-R.json."""
    torch.set_num_threads(1)
    timeout = float(os.environ.get("TEST_TIMEOUT_S", "60"))
    env = D.init("cpu", timeout_s=timeout)
    rec = {"rank": env.rank, "world": env.world, "source": env.source, "is_main": D.is_main()}
    if mode == "collectives":
        mine = D.shard(list(range(N_ITEMS)), env.rank, env.world)
        local = sum((item_grad(i) for i in mine), torch.zeros(P))
        mean = D.all_reduce_mean(local, len(mine))
        alone = torch.stack([item_grad(i) for i in range(N_ITEMS)]).mean(0)  # the 1-rank gradient
        rec["max_diff"] = float((mean - alone).abs().max())
        # One item on 2 ranks: rank 1 holds none (count 0) and still takes part.
        one = D.shard([3], env.rank, env.world)
        rec["one_diff"] = float((D.all_reduce_mean(sum((item_grad(i) for i in one), torch.zeros(P)), len(one))
                                 - item_grad(3)).abs().max())  # fmt: skip
        s1, s2 = D.all_reduce_sum(
            [torch.full((2, 2), env.rank + 1.0), torch.tensor([env.rank], dtype=torch.int64)]
        )
        rec["sums"] = [s1.tolist(), s2.tolist(), str(s2.dtype)]
        rec["gathered"] = D.gather_shards([f"outcome-{i}" for i in mine])
    elif mode in ("kill", "hang"):
        D.barrier()
        if env.rank == 1:
            if mode == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(600)  # alive, never reaching the collective (the test kills it)
        time.sleep(0.5)
        t0 = time.monotonic()
        try:
            D.all_reduce_sum([torch.ones(4)])
        except Exception as err:  # what a dead peer raises: the job must end, not hang
            rec.update(error=f"{type(err).__name__}: {err}"[:300], waited_s=time.monotonic() - t0)
            (out / f"rank-{env.rank}.json").write_text(json.dumps(rec))
            return 3
    elif mode == "update":
        rec["runs"] = [_update_run(cfg, env, out) for cfg in json.loads(os.environ["TEST_CFGS"])]
    elif mode == "preempt":  # wait for the test's signal to the launcher, then stop as the trainer does
        signals = []
        for s in preempt.SIGNALS:
            signal.signal(s, lambda signum, frame: signals.append(signal.Signals(signum).name))
        D.barrier()
        (out / f"ready-{env.rank}").write_text("")
        t0 = time.monotonic()
        while not signals and time.monotonic() - t0 < 60:
            time.sleep(0.05)
        time.sleep(0.5 + env.rank)  # rank 1 reaches the report last: rank 0 must wait for it at the barrier
        rec["signals"] = signals
        (out / f"rank-{env.rank}.json").write_text(json.dumps(rec))
        D.report_preempted()
        return preempt.EXIT_PREEMPTED
    (out / f"rank-{env.rank}.json").write_text(json.dumps(rec))
    D.close()
    return 0


def _update_run(cfg_dict: dict, env: D.Env, out: Path) -> dict:
    """One step's episodes rolled out in full (the same in every process: same seeds, one thread), then 3
    updates on this rank's share of them (its problems' calls, advantages from the full groups): the adapters
    and per-role stats after each."""
    from marlflow.cli.train import build_trainer
    from marlflow.core.config import RunConfig
    from marlflow.training import rollout as ro
    from marlflow.training import update as upd

    grads: list = []  # each policy's gradient as the metrics, the intervention and clipping read it
    finish = upd.finish_policy

    def recording(pg, *args, **kwargs):
        grads.append([pg.policy, pg.raw.tolist()])
        return finish(pg, *args, **kwargs)

    upd.finish_policy = recording  # the trainer calls it through the module

    cfg = RunConfig.from_dict(cfg_dict)
    trainer = build_trainer(cfg, out / f"{cfg.run_id}-rank{env.rank}-of{env.world}")
    problems = trainer.problems_for(1)
    ctx = trainer._ctx(cfg.grpo.temperature, seed=ro.rollout_seed(cfg.seed, 1))
    episodes = ro.train_episodes(cfg, trainer.task, problems, ctx)
    batch = ro.flatten(cfg, episodes)
    mine = {p.uid for p in D.shard(problems, env.rank, env.world)}
    sel = [i for i, (e, _) in enumerate((e, c) for e in episodes for c in e.calls) if e.problem.uid in mine]
    calls, adv = [batch.calls[i] for i in sel], batch.advantages[sel]
    stats = []
    for k in range(3):  # the middle update without per-slot gradients (a step between grad_metrics_every)
        st = trainer.update(calls, adv, metrics=k != 1)
        stats.append({role: {m: float(v) for m, v in d.items()} for role, d in st.items()})
    adapters = {
        p: torch.cat([t.detach().flatten() for t in ps.params]).tolist() for p, ps in trainer.policies.items()
    }
    upd.finish_policy = finish
    return {"run_id": cfg.run_id, "local_calls": len(calls), "all_calls": len(batch.calls), "grads": grads,
            "live": int((batch.advantages != 0).sum()), "stats": stats, "adapters": adapters,
            "lr": cfg.grpo.learning_rate}  # fmt: skip


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _clean_env(**extra) -> dict:
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "RANK", "WORLD_SIZE", "MASTER_"))
    }
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT / "src"), **extra)
    return env


def _slurm_ranks(mode: str, out: Path, **extra) -> list[subprocess.Popen]:
    """Two processes with the variables srun sets for a 2-task step on one node (rendezvous derived)."""
    port, procs = _free_port(), []
    for r in range(2):
        env = _clean_env(SLURM_JOB_ID="77", SLURM_STEP_ID="0", SLURM_PROCID=str(r), SLURM_NTASKS="2",
                         SLURM_LOCALID=str(r), SLURM_STEP_NODELIST="localhost", MASTER_PORT=str(port), **extra)  # fmt: skip
        procs.append(subprocess.Popen([sys.executable, str(HERE), mode, str(out)], env=env, cwd=ROOT,
                                      stderr=subprocess.PIPE, text=True))  # fmt: skip
    return procs


def _read(out: Path, rank: int) -> dict:
    return json.loads((out / f"rank-{rank}.json").read_text())


@pytest.mark.slow
def test_two_torchrun_ranks_all_reduce_to_the_one_rank_gradient_and_gather_in_order(tmp_path):
    cmd = D.launch_argv(2, [], _clean_env())  # the launcher's own torchrun command, pointed at this worker
    cmd = [*cmd[:3], str(HERE), "collectives", str(tmp_path)]
    r = subprocess.run(cmd, env=_clean_env(), cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    recs = [_read(tmp_path, k) for k in (0, 1)]
    assert [(x["rank"], x["world"], x["source"], x["is_main"]) for x in recs] == [
        (0, 2, "torchrun", True), (1, 2, "torchrun", False)]  # fmt: skip
    for x in recs:
        assert x["max_diff"] < 1e-6 and x["one_diff"] < 1e-6
        assert x["sums"] == [[[3.0, 3.0], [3.0, 3.0]], [1], "torch.int64"]
        assert x["gathered"] == [f"outcome-{i}" for i in range(N_ITEMS)]


@pytest.mark.slow
def test_a_sigkilled_rank_ends_the_other_within_seconds(tmp_path):
    procs = _slurm_ranks("kill", tmp_path, TEST_TIMEOUT_S="60")
    t0 = time.monotonic()
    codes = [p.wait(timeout=60) for p in procs]
    elapsed = time.monotonic() - t0
    assert codes[1] == -signal.SIGKILL
    # the survivor raised in the collective (3), or did and then aborted in gloo's teardown at exit (SIGABRT:
    # 1 of 6 runs here; see the stuck-rank test below)
    assert codes[0] in (3, -signal.SIGABRT), procs[0].stderr.read()[-3000:]
    rec = _read(tmp_path, 0)
    assert rec["error"].startswith("RuntimeError"), rec
    assert rec["source"] == "slurm" and rec["waited_s"] < 30, rec  # a closed connection, well before 60 s
    assert elapsed < 45


@pytest.mark.slow
def test_a_stuck_rank_ends_the_other_at_the_collective_timeout(tmp_path):
    procs = _slurm_ranks("hang", tmp_path, TEST_TIMEOUT_S="3")
    try:
        code = procs[0].wait(timeout=60)
    finally:
        procs[1].kill()
        procs[1].wait()
    # 3: the worker's return after the collective raised. After a timed-out gloo recv with the peer still
    # alive, the process group's teardown at interpreter exit can also std::terminate (SIGABRT: 2-3 of 6 runs at
    # 7ad8917 and 3 of 6 at 63efd3f on a loaded 2-core machine, torch 2.13): the rank has ended either way, with
    # a failing code, which is what the launcher needs (not 75, not a hang).
    assert code in (3, -signal.SIGABRT), procs[0].stderr.read()[-3000:]
    rec = _read(tmp_path, 0)
    assert rec["error"].startswith("RuntimeError") and "Timed out" in rec["error"], rec
    assert 2.5 <= rec["waited_s"] < 20, rec  # the 3 s timeout, not the 600 s the stuck rank sleeps


# Chunk-level token means (TRL's per-chunk entropy and clip ratio, weighted by the chunk's calls): they depend on
# how a rank's calls are cut into chunks, as they do on micro_batch_size in one process; not gradient metrics.
CHUNK_MEANS = ("entropy", "clip_frac")


@pytest.mark.slow
def test_two_ranks_update_like_one_process_sp_and_ip(tmp_path):
    """One update: 2 gloo ranks, each holding its own problems' calls of a step, compute the gradient
    and the per-role gradient metrics of one process that holds every call, for Voting SP (parallel slots on
    one adapter) and Eval-Opt IP (two adapters, rounds only some episodes reach), over 3 updates.

    The gradient (what every metric, the intervention and clipping read) agrees within 1e-5 of its largest
    entry, and the ranks agree with each other exactly. The adapters agree within 0.1 learning rate, not 1e-5:
    AdamW's first steps move a coordinate by ~lr x g / (|g| + 1e-8), so a coordinate whose gradient is a few
    1e-9 (about half of them here) turns a 1e-10 difference in summation order into ~1e-4 x lr
    (docs/slurm.md, "Several GPUs per run"). A wrong reduction (a mean instead of a sum, local loss
    normalisers) changes the gradient by a factor, which the gradient check catches and Adam would hide."""
    model = ROOT / "src/marlflow/models/toy_model"
    cfgs = [_cfg(model=str(model), grpo=None, workflow=w, sharing=sh) for w, sh in
            (("voting", "sp"), ("eval_opt", "ip"))]  # fmt: skip
    env = {"TEST_CFGS": json.dumps([c.to_dict() for c in cfgs]), "HF_HUB_OFFLINE": "1"}
    one = tmp_path / "one"
    one.mkdir()
    alone = subprocess.Popen([sys.executable, str(HERE), "update", str(one)], env=_clean_env(**env), cwd=ROOT,
                             stderr=subprocess.PIPE, text=True)  # fmt: skip
    procs = _slurm_ranks("update", tmp_path, **env)
    codes = [p.wait(timeout=600) for p in [alone, *procs]]
    assert codes == [0, 0, 0], [p.stderr.read()[-3000:] for p in [alone, *procs]]
    ref, r0, r1 = _read(one, 0), _read(tmp_path, 0), _read(tmp_path, 1)
    assert ref["world"] == 1 and r0["world"] == r1["world"] == 2
    for a, b, c in zip(ref["runs"], r0["runs"], r1["runs"]):
        rid = a["run_id"]
        assert b["local_calls"] + c["local_calls"] == a["local_calls"] == a["all_calls"]
        assert 0 < b["local_calls"] < a["all_calls"] and a["live"] > 0, rid
        assert b["grads"] == c["grads"] and b["adapters"] == c["adapters"] and b["stats"] == c["stats"]
        first = len(cfgs[0].policies if rid.startswith("voting") else cfgs[1].policies)  # the first update's
        assert [p for p, _ in b["grads"]] == [p for p, _ in a["grads"]]
        for (policy, ga), (_, gb) in zip(a["grads"][:first], b["grads"][:first]):
            ga, gb = torch.tensor(ga), torch.tensor(gb)
            assert ga.abs().max() > 0 and (gb - ga).abs().max() <= 1e-5 * ga.abs().max(), (rid, policy)
        for policy, w in a["adapters"].items():
            diff = (torch.tensor(b["adapters"][policy]) - torch.tensor(w)).abs().max().item()
            assert diff <= 0.1 * a["lr"], (rid, policy, diff)
        for k, (sa, sb) in enumerate(zip(a["stats"], b["stats"])):
            assert sa.keys() == sb.keys(), (rid, k)
            for role in sa:
                assert sa[role].keys() == sb[role].keys(), (rid, k, role)
                for m, v in sa[role].items():
                    if m not in CHUNK_MEANS:
                        assert sb[role][m] == pytest.approx(v, rel=1e-4, abs=1e-5), (rid, k, role, m)


# ------------------------------------------------------------------------------------------ the launcher's exit code


def test_launch_exit_code():
    """75 when rank 0 reported a stop after its checkpoint, whatever torchrun (1) or srun (75, 137: the highest
    task code) made of the ranks' 75s; otherwise the launcher's own code, 128 + N for a signal N; 0 stays 0."""
    assert D.launch_exit_code(0, False) == 0 and D.launch_exit_code(0, True) == 0
    for code in (1, 75, 137, 143, -9):
        assert D.launch_exit_code(code, True) == preempt.EXIT_PREEMPTED
    assert [D.launch_exit_code(c, False) for c in (1, 2, 75, 137, -9, -15)] == [1, 2, 75, 137, 137, 143]


def test_the_same_signal_twice_at_once_is_one_request(preempt_installed):
    """Under SLURM each rank gets the job's SIGUSR1 from slurmd and again from srun (measured 1 ms apart on the
    CI cluster): one request. The same signal later, or another signal, is a second one and exits at once."""
    os.kill(os.getpid(), signal.SIGUSR1)
    os.kill(os.getpid(), signal.SIGUSR1)
    assert preempt.requested()
    preempt._requested = (signal.SIGUSR1, time.time() - preempt.REPEAT_S - 1)
    with pytest.raises(SystemExit) as exit_:
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(1)  # the handler runs at the next bytecode; never reached
    assert exit_.value.code == 128 + signal.SIGUSR1


def _launch(mode: str, out: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(HERE), "launch", mode, str(out)], env=_clean_env(), cwd=ROOT,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip


@pytest.mark.slow
def test_a_signal_to_the_launcher_stops_the_ranks_and_the_run_exits_75(tmp_path):
    """SIGUSR1 to the launcher (marlflow.cli.train's process for a ranks-2 run) reaches each torchrun rank once;
    the ranks stop, rank 0 reports, and the run exits 75 although torchrun itself exits 1."""
    p = _launch("preempt", tmp_path)
    t0 = time.monotonic()
    while not all((tmp_path / f"ready-{r}").exists() for r in (0, 1)):
        assert p.poll() is None and time.monotonic() - t0 < 90, p.stderr.read()[-3000:]
        time.sleep(0.1)
    p.send_signal(signal.SIGUSR1)
    code = p.wait(timeout=60)
    err = p.stderr.read()
    assert code == preempt.EXIT_PREEMPTED, err[-3000:]
    assert "launcher got SIGUSR1, passed to torchrun" in err
    assert [_read(tmp_path, r)["signals"] for r in (0, 1)] == [["SIGUSR1"], ["SIGUSR1"]]
    assert not (tmp_path / ".preempted").exists()  # read and removed by the launcher


@pytest.mark.slow
def test_a_killed_rank_ends_the_launch_with_a_failure_not_75(tmp_path):
    """One of 2 torchrun ranks is SIGKILLed: the run ends within seconds with a non-zero code that is not 75
    (nothing was checkpointed, so it is not a preemption)."""
    t0 = time.monotonic()
    p = _launch("kill", tmp_path)
    code = p.wait(timeout=90)
    assert code not in (0, preempt.EXIT_PREEMPTED), p.stderr.read()[-3000:]
    assert time.monotonic() - t0 < 90


def launcher(mode: str, out: Path) -> int:
    """marlflow.cli.train's launcher branch around 2 torchrun ranks of `worker(mode)`: the run's exit code."""
    cmd = D.launch_argv(2, [], os.environ)
    cmd = [*cmd[: cmd.index("-m")], str(HERE), mode, str(out)]
    return D.launch(cmd, os.environ, out / ".preempted")


if __name__ == "__main__":
    sys.exit((launcher if sys.argv[1] == "launch" else worker)(sys.argv[2 if sys.argv[1] == "launch" else 1],
                                                               Path(sys.argv[-1])))  # fmt: skip

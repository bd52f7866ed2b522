"""cliff_guard: on a cliff in validation accuracy, back to the best evaluation's weights.

    cg: {kind: cliff_guard, max_restores: 2, lr_factor: 0.5}

The online form of the analysis's cliff flag (marlflow.core.stats.curve_tests). Its curve is the run's
validation evals (task.val_size problems: it never selects on the test problems accuracy is reported on)
since the last restore, starting with the best one. After each eval that is not a new best, the curve is
tested exactly as the analysis tests a finished run (every eval before the last is a candidate peak,
compared with the mean of the up-to-`window` evals after it, by max(0.05, z * SE of the difference), z from
a union bound over the candidates), at level alpha / L where L is the number of evals the run makes after
step 0 (`common.eval_looks`): testing after every eval is L looks at one curve, and the union bound over them
keeps the chance that a flat run is ever restored at or below alpha (simulated: <= 2.3% at alpha 0.04, p in
{0.3, 0.5, 0.8}, n in {32, 200}, 13 or 51 evals; a 12-point drop at n = 200 is caught in 96% of runs, mostly
by the next eval).

At a new best (strictly above the best so far) it keeps a copy of every adapter and its AdamW state
(`State.best`, checkpointed). On a cliff it logs guard_drop, guard_drop_se and guard_z (split train, role
all); if restores are left (at most `max_restores` per run), it puts the copy back, multiplies every policy's
learning rate (and its schedule) by `lr_factor`, and logs guard_restore (the step restored to),
guard_restores and guard_lr_scale. Training goes on at the next step: the step counter and the data schedule
go on, so the curve continues from the restored weights.
"""

from __future__ import annotations

import logging

from marlflow.core import stats
from marlflow.interventions.common import Evaluated, Intervention, State, eval_looks

log = logging.getLogger("marlflow.interventions.cliff_guard")


def val_accuracy(rows: list[dict], step: int) -> tuple[float, int]:
    """(accuracy, n) of the evaluation of `step` on the validation problems (split "val", role "all") among
    the metric rows `rows`; the test rows are never read, so a restore never selects on the problems accuracy
    is reported on."""
    got = {r["metric"]: r["value"] for r in rows if r["split"] == "val" and r["role"] == "all"
           and r["step"] == step and r["metric"] in ("accuracy", "n_eval")}  # fmt: skip
    return got["accuracy"], int(got["n_eval"])


def guard_observe(state: State, step: int, acc: float, n: int) -> bool:
    """Add an eval to the guard's curve; True if it is a new best (strictly above the best so far, so ties
    keep the earlier step), when the caller should replace `state.best` with a copy of the current weights."""
    state.evals.append((int(step), float(acc), int(n)))
    return state.best is None or acc > state.best["acc"]


def guard_check(evals: list[tuple[int, float, int]], restores: int, spec: dict, looks: int) -> dict:
    """The guard's decision on its curve `evals` [(step, accuracy, n)], in eval order.

    The analysis's cliff test (stats.curve_tests, window spec["window"]) at level spec["alpha"] / looks.
    Returns {cliff, fire, drop, drop_se, drop_z}: cliff, the test's verdict (never on a last eval at or above
    every earlier one: the current weights are as good as any copy); fire, cliff and restores <
    spec["max_restores"]; drop, drop_se, drop_z, the test's peak - terminal difference, its SE and its
    critical value."""
    acc = [a for _, a, _ in evals]
    r = stats.curve_tests([acc], [[n for *_, n in evals]], has_base=False, window=spec["window"],
                          alpha=spec["alpha"] / max(1, looks))  # fmt: skip
    cliff = len(acc) >= 2 and acc[-1] < max(acc[:-1]) and bool(r["cliff"][0])
    out = {k: float(r[k][0]) for k in ("drop", "drop_se", "drop_z")}
    return {"cliff": cliff, "fire": cliff and restores < spec["max_restores"], **out}


class CliffGuard(Intervention):
    """After each evaluation: keep the best eval's weights, and put them back on a cliff."""

    reads_evals = True  # step 0's validation accuracy is the curve's first point

    def after_eval(self, ev: Evaluated) -> dict[str, float]:
        spec, st = self.spec, self.state
        acc, n = val_accuracy(ev.rows, ev.step)
        if guard_observe(st, ev.step, acc, n):
            st.best = {"step": ev.step, "acc": acc, "n": n, **ev.snapshot()}
            return {}
        g = self.cfg.grpo
        check = guard_check(st.evals, st.restores, spec, eval_looks(g.steps, g.eval_every))
        if not check["cliff"]:
            return {}
        values = {"guard_drop": check["drop"], "guard_drop_se": check["drop_se"], "guard_z": check["drop_z"]}
        if check["fire"]:
            best, f = st.best, spec["lr_factor"]
            ev.restore(best, f)
            st.restores, st.lr_scale = st.restores + 1, st.lr_scale * f
            st.evals = [(best["step"], best["acc"], best["n"])]
            values.update(guard_restore=best["step"], guard_restores=st.restores, guard_lr_scale=st.lr_scale)
            log.warning("step %d: cliff_guard: validation accuracy %.3f, a cliff (drop %.3f, SE %.3f); restored "
                        "the best eval's weights (step %d, %.3f), learning rate x%g (restore %d of %d)",
                        ev.step, acc, check["drop"], check["drop_se"], best["step"], best["acc"],
                        st.lr_scale, st.restores, spec["max_restores"])  # fmt: skip
        return values

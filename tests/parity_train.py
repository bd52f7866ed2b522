"""`python tests/parity_train.py --config C --out D`: marlflow.cli.train with the test-only `parity` and `drift`
tasks.

The parity task (reward = output length is odd) gives every GRPO group reward variance even on a barely
trained model, so subprocess tests of resume and kills exercise real, non-zero updates.

The drift task trains on parity too, but scores a held-out problem (a test problem, or one of the run's
validation problems, `Drift.held_out`) 1 only while the workflow's output is the one it gave at its first
evaluation, step 0's. The record sits beside the run folder, one per step-0 evaluation
(`marlflow.training.base_eval.key`): a resumed run, and a run that reads step 0 from the cell's shared evaluation instead
of scoring it itself, score against the same record.
eval accuracy starts at 1 and falls as soon as training changes what the workflow says, a certain cliff for
cliff_guard's tests, and it comes back to 1 when the first eval's weights are restored.

MARLFLOW_TEST_SIGNAL=SIGNAL@POINT:STEP makes the process send itself a real SIGNAL (SIGTERM, SIGUSR1) at a
named point of training step STEP, for the preemption tests (marlflow.training.preempt): `rollout` = just after the
step's first generate call of its rollout (the next stage is still to come), `update` = as the update starts.
"""

import json
import os
import sys
from pathlib import Path

from marlflow.tasks import register
from marlflow.tasks.toy import ToyMath, _is_test


@register("parity")
class Parity(ToyMath):
    name = "parity"

    def score(self, problems, outputs):
        return [float(len(o) % 2) for o in outputs]


@register("drift")
class Drift(ToyMath):
    name = "drift"
    record: Path | None = None  # set from --out below (or by an in-process test)
    held_out: frozenset = frozenset()  # uids of the run's validation problems (marlflow.tasks.splits)

    def score(self, problems, outputs):
        test = [_is_test(p.prompt) or p.uid in self.held_out for p in problems]
        if not any(test):
            return [float(len(o) % 2) for o in outputs]
        base = json.loads(self.record.read_text()) if self.record.exists() else {}
        new = {p.uid: o for p, o, t in zip(problems, outputs, test) if t and p.uid not in base}
        if new:  # a problem's first eval (step 0's): the workflow's final output is the reference
            tmp = self.record.with_suffix(".tmp")
            tmp.write_text(json.dumps({**base, **new}))
            os.replace(tmp, self.record)
            base = {**base, **new}
        return [
            float(base.get(p.uid) == o) if t else float(len(o) % 2)
            for p, o, t in zip(problems, outputs, test)
        ]


def signal_at(spec: str) -> None:
    """Wrap the trainer so that it signals itself at `spec` = SIGNAL@POINT:STEP (see the module docstring)."""
    import signal

    from marlflow import workflows
    from marlflow.training import trainer as T

    name, point = spec.split("@")
    point, step = point.split(":")
    sig, step = signal.Signals[name], int(step)
    assert point in ("rollout", "update"), spec
    in_step, fired = {"step": None}, []

    def fire(now: int | None) -> None:
        if now == step and not fired:  # once per process
            fired.append(now)
            os.kill(os.getpid(), sig)

    train_step, update, generate = (
        T.MultiAgentGRPOTrainer.train_step,
        T.MultiAgentGRPOTrainer.update,
        workflows.Context.generate,
    )

    def train_step_(self, s):
        in_step["step"] = s
        try:
            return train_step(self, s)
        finally:
            in_step["step"] = None

    def update_(self, *args, **kwargs):
        if point == "update":
            fire(in_step["step"])
        return update(self, *args, **kwargs)

    def generate_(self, pending):
        generate(self, pending)
        if point == "rollout" and self.should_stop is not None:  # a training rollout, after its first stage
            fire(in_step["step"])

    T.MultiAgentGRPOTrainer.train_step = train_step_
    T.MultiAgentGRPOTrainer.update = update_
    workflows.Context.generate = generate_


if __name__ == "__main__":
    from marlflow.cli.train import main
    from marlflow.core.config import RunConfig
    from marlflow.tasks.splits import run_splits
    from marlflow.training import base_eval

    if os.environ.get("MARLFLOW_TEST_SIGNAL"):
        signal_at(os.environ["MARLFLOW_TEST_SIGNAL"])
    out, config = (Path(sys.argv[sys.argv.index(flag) + 1]) for flag in ("--out", "--config"))
    cfg = RunConfig.load(config)
    Drift.record = out.parent / f"drift_base-{base_eval.key(cfg)}.json"
    Drift.held_out = frozenset(p.uid for p in run_splits(Drift(), cfg.task)[1])
    sys.exit(main())

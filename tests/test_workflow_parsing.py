"""Reward and format parsing for every role, and the fallbacks taken on unparseable output."""

from marlflow.core.config import TaskSpec
from marlflow.tasks import get_task
from marlflow.tasks.math import last_boxed
from marlflow.workflows.eval_opt import parse_verdict
from marlflow.workflows.orch_workers import FALLBACK_STRATEGY, parse_strategies
from marlflow.workflows.voting import parse_pick


def test_last_boxed_nested():
    assert last_boxed(r"a \boxed{1} b \boxed{\frac{1}{2}}") == r"\frac{1}{2}"
    assert last_boxed("no box") is None
    assert last_boxed(r"\boxed{unclosed") is None


def test_generator_reward_toy_math():
    task = get_task("toy_math")
    p = task.load("test", TaskSpec(name="toy_math", eval_size=3))[0]
    right, wrong = f"1;\\boxed{{{p.answer}}}", f"\\boxed{{{int(p.answer) + 1}}}"
    assert task.score([p, p, p], [right, wrong, "garbage"]) == [1.0, 0.0, 0.0]


def test_evaluator_verdicts():
    assert parse_verdict(r"\boxed{Correct}") == (True, True)
    assert parse_verdict(r"\boxed{incorrect} step 2") == (False, True)
    assert parse_verdict("looks fine to me") == (False, False)  # unparseable: treated as Incorrect, counted


def test_aggregator_picks():
    assert parse_pick(r"\boxed{2}", 3) == (1, True)
    assert parse_pick(r"\boxed{7}", 3) == (0, False)  # out of range, no other digit: candidate 1
    assert parse_pick("I think solution 3", 3) == (2, False)  # first digit fallback
    assert parse_pick("none of them", 3) == (0, False)


def test_orchestrator_strategies():
    text = "STRATEGY 1: left to right\nSTRATEGY 2: add then subtract\nSTRATEGY 3: x\nSTRATEGY 4: y"
    assert parse_strategies(text, 3) == (["left to right", "add then subtract", "x"], True)
    assert parse_strategies("just do it", 3) == ([FALLBACK_STRATEGY], False)


def test_candidate_metrics_reuse_the_scored_final():
    """Eval's any_correct / generator_accuracy score each candidate once: the picked Voting candidate is the
    episode's final, already scored by the rollout, and is not sent to the task again."""
    from marlflow.workflows import Episode, eval_metrics

    task = get_task("toy_math")
    p = task.load("test", TaskSpec(name="toy_math", eval_size=3))[0]
    right, wrong = f"\\boxed{{{p.answer}}}", f"\\boxed{{{int(p.answer) + 1}}}"
    scored = []

    class Counting:
        def score(self, problems, texts):
            scored.extend(texts)
            return task.score(problems, texts)

    eps = [Episode(problem=p, rollout=0, final=right, reward=1.0, info={"candidates": [wrong, right, wrong]}),
           Episode(problem=p, rollout=1, final=wrong, reward=0.0, info={"candidates": [wrong, wrong, wrong]})]  # fmt: skip
    m = eval_metrics("voting", eps, Counting())
    assert m == {"any_correct": 0.5, "generator_accuracy": 1 / 6}
    assert scored == [wrong, wrong]  # episode 0's two wrong voters; the rest equal a scored final
    eps[0].info["rounds"] = 2
    assert eval_metrics("eval_opt", eps, task) == {"rounds_mean": 1.5}
    assert eval_metrics("single", eps, task) == {}


def test_trainer_keeps_trls_evaluate():
    """The workflow eval is `evaluate_workflow(step)`; the trainer is no transformers Trainer, and the TRL trainer
    that TrlLoss holds keeps transformers' Trainer.evaluate (nothing of marlflow's shadows it)."""
    from transformers import Trainer

    from marlflow.training.trainer import MultiAgentGRPOTrainer
    from marlflow.training.trl_loss import _GRPOTrainer

    assert _GRPOTrainer.evaluate is Trainer.evaluate
    assert not issubclass(MultiAgentGRPOTrainer, Trainer)
    assert callable(MultiAgentGRPOTrainer.evaluate_workflow)

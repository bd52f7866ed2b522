"""Toy tasks and the warm-start corpus: what the toy model is taught is true, and the RL lever is real.

The toy preset's learning signal rests on two facts checked here: worked solutions are right and the
careless misconception (tasks.toy.CARELESS) is wrong on every problem; and the corpus labels (evaluator
verdicts, aggregator picks) agree with what the real verifier says.
"""

import random
from collections import Counter

import pytest

from marlflow.core.config import TaskSpec
from marlflow.models.warmstart import ROLES, _example, role_examples, score_outputs
from marlflow.tasks import get_task
from marlflow.tasks.math import last_boxed
from marlflow.tasks.toy import CARELESS, GENERATOR_STYLES

TOY = ("toy_math", "toy_code")


def _problems(name, split="test", n=60):
    return get_task(name).load(split, TaskSpec(name=name, eval_size=n, train_size=n))


@pytest.mark.parametrize("name", TOY)
def test_splits_are_disjoint_and_the_test_split_holds_200(name):
    task = get_task(name)
    test = task.load("test", TaskSpec(name=name, eval_size=10_000))
    train = task.load("train", TaskSpec(name=name))
    assert len(test) >= 200
    assert not {p.prompt for p in test} & {p.prompt for p in train}


@pytest.mark.parametrize("name", TOY)
def test_every_strategy_is_right_except_the_careless_one_which_is_always_wrong(name):
    task, problems = get_task(name), _problems(name)
    assert set(GENERATOR_STYLES[task.kind]) <= set(task.strategies)
    for strategy in task.strategies:
        scores = task.score(problems, [task.solution(p, strategy, random.Random(0), 0.0) for p in problems])
        assert scores == [0.0 if strategy in CARELESS else 1.0] * len(problems), strategy
    slipped = [task.solution(p, task.strategies[0], random.Random(k), 1.0) for k, p in enumerate(problems)]
    assert sum(task.score(problems, slipped)) == 0


@pytest.mark.parametrize("name", TOY)
def test_corpus_labels_agree_with_the_verifier(name):
    task, problems = get_task(name), _problems(name, "train", 40)
    rng = random.Random(0)
    ev = role_examples(task, problems, "evaluator", rng)
    sols = [e.messages[-2]["content"] for e in ev]  # the judged generator turn
    assert [e.meta["truth"] for e in ev] == [bool(s) for s in task.score(problems, sols)]
    assert {e.meta["truth"] for e in ev} == {True, False}
    for e in role_examples(task, problems, "aggregator", rng):
        cands = e.messages[-1]["content"].split("--- Solution ")[1:]
        cands = [c.split("---\n", 1)[1].strip() for c in cands]
        scores = task.score([e.problem] * len(cands), cands)
        assert e.meta["good"] == [i + 1 for i, s in enumerate(scores) if s]


@pytest.mark.slow
@pytest.mark.parametrize("name", TOY)
def test_generator_corpus_mixes_careful_and_careless_styles(name):
    task, problems = get_task(name), _problems(name, "train", 400)
    targets = [e.target for e in role_examples(task, problems, "generator", random.Random(0))]
    share = sum(task.score(problems, targets)) / len(targets)
    careful = 1 - GENERATOR_STYLES[task.kind][next(iter(CARELESS & set(task.strategies)))]
    assert abs(share - careful) < 0.08  # right exactly when the careful style was drawn


def test_synthesizer_target_is_the_agreed_answer_else_the_first():
    task, problems = get_task("toy_math"), _problems("toy_math", "train", 200)
    for e in role_examples(task, problems, "synthesizer", random.Random(0)):
        answers = [last_boxed(c) for c in e.messages[-1]["content"].split("--- Solution ")[1:]]
        top, count = Counter(answers).most_common(1)[0]
        assert last_boxed(e.target) == (top if count >= 2 else answers[0])
        assert e.target in e.messages[-1]["content"]  # a whole candidate, copied


@pytest.mark.parametrize("name", TOY)
def test_every_role_example_is_scored(name):
    task, problems = get_task(name), _problems(name, "train", 8)
    for role in ROLES:
        ex = [_example(role, task, p, random.Random(k)) for k, p in enumerate(problems)]
        scores = score_outputs(task, ex, [e.target for e in ex])
        assert scores is not None and len(scores) == len(ex)
        if role in ("evaluator", "orchestrator"):
            assert all(scores), role  # the corpus's own answer for these roles is right by construction


@pytest.mark.parametrize("name", TOY)
def test_careless_detector_tells_the_two_styles_apart(name):
    task, problems = get_task(name), _problems(name, n=20)
    careful, careless = task.strategies[0], next(iter(CARELESS & set(task.strategies)))
    for p in problems:
        assert not task.careless(task.solution(p, careful, random.Random(0), 0.0))
        assert task.careless(task.solution(p, careless, random.Random(0), 0.0))

"""Toy world v2 (docs/toy-world-v2.md): its levers are what the design says, and its shipped models are the
ones its sources build.

- toy_code2: the worked style is right and the careless lambda wrong on every problem; a worked author who
  skips the edge clause is wrong exactly on the problems that have it; corpus labels agree with the sandbox.
- role conflict: the supervisors' corpus has a re-solving mode at the stated odds, and what it writes is not a
  pick the Voting workflow can read (a format failure), while producers' worked mode is their right one.
- the shipped v2 models (toy2s, toy2): weights hash to their warmstart.json, built from the current v2
  sources (`toybuild2.toy_version`), each <= 5 MB, and `prepare` copies them; v1's version is untouched.
"""

from __future__ import annotations

import json
import random
import shutil

import pytest

from marlflow.core.config import TaskSpec
from marlflow.models import loading, toybuild, toybuild2, warmstart2
from marlflow.models.warmstart import _synthesis
from marlflow.tasks import get_task
from marlflow.tasks.toy import CARELESS
from marlflow.tasks.toy2 import EDGE, EDGE_HANDLED, has_edge, solution
from marlflow.workflows.voting import parse_pick


def _problems(name="toy_code2", split="test", n=80):
    return get_task(name).load(split, TaskSpec(name=name, eval_size=n, train_size=n))


def test_code2_split_is_disjoint_and_half_the_problems_have_the_edge_clause():
    task = get_task("toy_code2")
    test = task.load("test", TaskSpec(name="toy_code2", eval_size=10_000))
    train = task.load("train", TaskSpec(name="toy_code2"))
    assert len(test) >= 200 and not {p.prompt for p in test} & {p.prompt for p in train}
    share = sum(map(has_edge, test)) / len(test)
    assert 0.4 < share < 0.6
    assert all("assert f(-3) ==" in p.tests for p in test)  # the negative input that tests the clause


def test_code2_worked_is_right_careless_wrong_and_skipping_the_clause_fails_exactly_where_it_is():
    task, problems = get_task("toy_code2"), _problems()
    for strategy in task.strategies:
        scores = task.score(problems, [task.solution(p, strategy, random.Random(0), 0.0) for p in problems])
        assert scores == [0.0 if strategy in CARELESS else 1.0] * len(problems), strategy
    skipped = task.score(problems, [solution(p.prompt, handle_edge=False) for p in problems])
    assert skipped == [0.0 if has_edge(p) else 1.0 for p in problems]


def test_code2_corpus_labels_agree_with_the_sandbox():
    task, problems = get_task("toy_code2"), _problems(split="train", n=60)
    rng = random.Random(0)
    drawn = [task.authored(p, task.strategies[0], rng, slip=False) for p in problems]
    assert [ok for _, ok in drawn] == [bool(s) for s in task.score(problems, [t for t, _ in drawn])]
    ev = warmstart2.role_examples(task, problems, "evaluator", rng)
    sols = [e.messages[-2]["content"] for e in ev]
    assert [e.meta["truth"] for e in ev] == [bool(s) for s in task.score(problems, sols)]
    for e in warmstart2.role_examples(task, problems, "aggregator", rng):
        cands = [c.split("---\n", 1)[1].strip() for c in e.messages[-1]["content"].split("--- Solution ")[1:]]
        scores = task.score([e.problem] * len(cands), cands)
        assert e.meta["good"] == [i + 1 for i, s in enumerate(scores) if s]


def test_worked_authors_handle_the_clause_at_the_stated_odds():
    task, problems = get_task("toy_code2"), [p for p in _problems(split="train", n=2000) if has_edge(p)]
    rng = random.Random(1)
    handled = [
        "abs(x)" in task.authored(p, task.strategies[0], rng, slip=False)[0] for p in problems[:600]
    ]  # fmt: skip
    assert abs(sum(handled) / len(handled) - EDGE_HANDLED) < 0.06
    assert EDGE in problems[0].prompt


@pytest.mark.parametrize("name", ["toy_math", "toy_code2"])
def test_supervisors_resolve_at_the_stated_odds_and_a_resolving_aggregator_gives_no_pick(name):
    task, problems = get_task(name), _problems(name, "train", 600)
    agg = warmstart2.role_examples(task, problems, "aggregator", random.Random(2))
    resolving = [e for e in agg if not e.target.startswith("\\boxed{")]
    assert abs(len(resolving) / len(agg) - warmstart2.AGGREGATOR_RESOLVES) < 0.06
    picks = [parse_pick(e.target, 3) for e in agg]
    assert all(ok for e, (_, ok) in zip(agg, picks) if e.target.startswith("\\boxed{"))
    # A re-solved answer is read as a pick only where its value happens to be 1..3 (math only: ~1 in 5 toy_math
    # answers), and then as a pick unrelated to the candidates.
    wellformed = sum(parse_pick(e.target, 3)[1] for e in resolving) / len(resolving)
    assert wellformed < (0.3 if name == "toy_math" else 1e-9)
    syn = warmstart2.role_examples(task, problems, "synthesizer", random.Random(3))
    # The re-solving synthesizer answers in a generator's style, whatever the workers agree on; its text often
    # equals a candidate's (same styles, same problem), so it departs from the agreement rule less often.
    cands = [
        [c.split("---\n", 1)[1].strip() for c in e.messages[-1]["content"].split("--- Solution ")[1:]]
        for e in syn
    ]
    departs = sum(e.target != _synthesis(task.kind, c) for e, c in zip(syn, cands)) / len(syn)
    assert 0.03 < departs <= warmstart2.SYNTHESIZER_RESOLVES + 0.05


def test_v1_sources_are_untouched_by_v2():
    """v2 builds on v1's modules without editing them: the shipped v1 model stays current."""
    assert (
        json.loads((loading.SHIPPED_TOY / "warmstart.json").read_text())["version"] == toybuild.toy_version()
    )
    assert toybuild2.toy_version() != toybuild.toy_version()


@pytest.mark.parametrize("scale", toybuild2.SCALES)
def test_shipped_v2_model_matches_its_sources_and_weights(scale, tmp_path):
    shipped = toybuild2.SHIPPED[scale]
    info = loading.check_shipped_toy(shipped)  # raises on a hash mismatch or stale sources
    assert info["version"] == toybuild2.toy_version() and info["world"] == 2 and info["scale"] == scale
    assert (info["seed"], info["threads"], info["steps"], info["solve_steps"]) == (
        0, toybuild.THREADS, toybuild.STEPS, toybuild.SOLVE_STEPS)  # fmt: skip
    assert (shipped / "model.safetensors").stat().st_size <= 5_000_000
    out = tmp_path / scale
    ready = loading.prepare(scale, scale, out)
    assert ready["source"] == "shipped" and ready["weights_sha256"] == info["weights_sha256"]
    assert (out / "model.safetensors").read_bytes() == (shipped / "model.safetensors").read_bytes()


def test_v2_scales_differ_in_capacity():
    params = {
        s: json.loads((toybuild2.SHIPPED[s] / "warmstart.json").read_text())["params"]
        for s in toybuild2.SCALES
    }
    assert params["toy2s"] < 0.7 * params["toy2"]


def test_stale_v2_model_names_the_v2_rebuild(tmp_path):
    source = tmp_path / "shipped"
    shutil.copytree(toybuild2.SHIPPED["toy2"], source)
    info = json.loads((source / "warmstart.json").read_text())
    (source / "warmstart.json").write_text(json.dumps(info | {"version": "0000000000000000"}))
    with pytest.raises(RuntimeError, match="is stale") as err:
        loading.prepare("toy2", "toy2", tmp_path / "out", shipped=source)
    assert "python -m marlflow.models.toybuild2 --scale toy2 --out src/marlflow/models/toy2_model" in str(
        err.value
    )

"""WorkflowSpec (marlflow.core.workflow_spec): the registry agrees with the workflow modules and with every module
that reads it; each spec's episode shape is what real episodes on the shipped toy model do; and a workflow
defined outside marlflow (tests/workflows_extra/debate.py, a two-round debate) trains a step and aggregates
through the registration hook alone.

    .venv/bin/pytest -q tests/test_workflow_spec.py
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch

from marlflow.core import workflow_spec as wspec
from marlflow.core.config import ConfigError, GRPOParams, RunConfig, TaskSpec
from marlflow.core.workflow_spec import (
    BUILTIN,
    CallSpec,
    WorkflowError,
    WorkflowSpec,
    spec_of,
    specs,
    workflow_names,
)

TESTS = Path(__file__).parent
ROOT = TESTS.parent
DEBATE = "workflows_extra.debate"


@pytest.fixture
def debate(monkeypatch):
    """The debate workflow registered the documented way (MARLFLOW_WORKFLOWS), for this test only."""
    monkeypatch.setattr(wspec, "_REGISTERED", {})  # registrations of this test do not outlive it
    monkeypatch.setenv(wspec.ENV_VAR, DEBATE)
    # workflows_extra is importable here and, through PYTHONPATH, in subprocesses
    monkeypatch.syspath_prepend(str(TESTS))
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")]))
    )
    return spec_of("debate")


def cfg_for(workflow: str, sharing: str = "sp", **kw) -> RunConfig:
    from marlflow.models.loading import SHIPPED_TOY

    grpo = dict(steps=1, problems_per_step=2, group_size=2, learning_rate=1e-2, warmup_steps=0,
                lr_scheduler="constant", eval_every=1, save_every=1, max_completion_length=16,
                max_prompt_length=256, lora_r=4, lora_alpha=8)  # fmt: skip
    return RunConfig(run_id=f"{workflow}-{sharing}-toy-math-s0", workflow=workflow, sharing=sharing, scale="toy",
                     task_axis="math", seed=0, task=TaskSpec(name="toy_math", eval_size=4, train_size=50),
                     model=str(SHIPPED_TOY), grpo=GRPOParams(**grpo), generation_dtype="model", **kw)  # fmt: skip


# ---------------------------------------------------------------- the registry


def test_registry_holds_each_builtin_module_spec_and_the_config_and_matrix_read_it():
    from marlflow.pipeline.matrix import schema

    assert workflow_names()[: len(BUILTIN)] == BUILTIN
    for name in BUILTIN:
        module = importlib.import_module(f"marlflow.workflows.{name}")
        assert module.SPEC is spec_of(name) and module.SPEC.name == name and module.SPEC.run is module.run
    assert [n for n, s in specs().items() if s.baseline] == ["single"]
    assert schema()["$defs"]["workflow"]["enum"] == list(workflow_names())
    for name, s in specs().items():
        cfg = cfg_for(name, "sp" if len(s.role_types) == 1 else "ip")
        assert cfg.role_types == s.role_types
        assert cfg.policies == (("shared",) if len(s.role_types) == 1 else s.role_types)
        shape = s.stages(cfg, "math")
        slots = [c.slot for stage in shape for c in stage]
        assert len(slots) == len(set(slots)) == s.calls_per_episode(cfg, "math")
        assert {c.role for stage in shape for c in stage} == set(s.role_types), name
        assert all(c.slot.rstrip("0123456789") == c.role for stage in shape for c in stage), name
        # first-stage slots are the first stage's; mandatory ones include all of it
        assert {c for c in slots if s.is_first_stage(c)} == {c.slot for c in shape[0]}, name
        assert all(s.is_mandatory(c.slot) for c in shape[0]), name
        if s.parallel_role:  # parallel calls: >= 2 of the role in one stage
            assert max(sum(s.is_parallel_slot(s.parallel_role, c.slot) for c in st) for st in shape) >= 2
        assert set(s.prompt_templates(cfg)) == set(s.role_types), name
    with pytest.raises(ConfigError, match="only sharing 'sp' applies"):
        cfg_for("single", "ip")


def test_eval_opt_default_rounds_are_read_from_its_spec():
    s = spec_of("eval_opt")
    assert s.default_rounds == {"math": 3, "code": 2}
    assert s.calls_per_episode(cfg_for("eval_opt"), "math") == 6
    assert s.calls_per_episode(cfg_for("eval_opt"), "code") == 4
    assert s.calls_per_episode(cfg_for("eval_opt", eval_opt_rounds=5), "code") == 10
    assert spec_of("voting").calls_per_episode(cfg_for("voting", n_votes=5), "math") == 6
    assert spec_of("orch_workers").calls_per_episode(cfg_for("orch_workers", n_workers=2), "math") == 4


def test_same_role_norm_is_allowed_where_the_spec_has_a_parallel_role():
    srn = dict(intervention="srn", intervention_spec={"kind": "same_role_norm"})
    with pytest.raises(
        ConfigError, match=r"parallel same-role calls \(voting, orch_workers\); workflow 'eval_opt'"
    ):
        cfg_for("eval_opt", "ip", **srn)
    assert cfg_for("orch_workers", "ip", **srn).intervention_spec == {"kind": "same_role_norm"}


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(name="Debate"), "name must be lower case"),
        (dict(supervisor=("referee", "generator")), "supervisor must be"),
        (dict(parallel_role="generator"), "parallel_role and parallel_slots go together"),
        (dict(solver_roles=("worker",)), "solver_roles names ['worker']"),
        (dict(own_boxed=r"\d+"), "own_boxed describes a supervisory role"),
        (dict(first_stage="generator(0"), "first_stage 'generator(0' is not a regular expression"),
        (dict(role_types=("generator", "generator")), "role_types must list each role type once"),
        (dict(default_rounds={"math": 0}), "default_rounds must map task kinds to rounds >= 1"),
    ],
)
def test_an_invalid_spec_is_refused_naming_the_field(change, message):
    fields = {f: getattr(spec_of("single"), f) for f in WorkflowSpec.__dataclass_fields__}
    with pytest.raises(WorkflowError, match=f"WorkflowSpec .*{message.replace('(', '.').replace('[', '.')}"):
        WorkflowSpec(**{**fields, "baseline": False, **change})


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(strategy=True), "strategy must be the slot whose output the strategies come from, or None"),
        (dict(strategy=""), "strategy must be the slot"),
        (dict(messages_for="--- Solution 1 ---"), "messages_for must be a function n -> messages or None"),
    ],
)
def test_an_invalid_call_spec_is_refused_naming_the_field(change, message):
    with pytest.raises(WorkflowError, match=f"CallSpec 'worker0': {message}"):
        CallSpec("worker0", "worker", (), **change)


def test_unknown_workflows_and_name_clashes_say_what_to_do(monkeypatch):
    monkeypatch.setattr(wspec, "_REGISTERED", {})
    with pytest.raises(WorkflowError, match="workflow 'debate' is unknown.*MARLFLOW_WORKFLOWS"):
        spec_of("debate")
    with pytest.raises(ConfigError, match="workflow 'debate' is unknown"):
        cfg_for("debate")
    fields = {f: getattr(spec_of("voting"), f) for f in WorkflowSpec.__dataclass_fields__}
    with pytest.raises(WorkflowError, match="'voting' is already registered"):
        wspec.register(WorkflowSpec(**fields))
    monkeypatch.setenv(wspec.ENV_VAR, "no_such_module_xyz")
    with pytest.raises(
        WorkflowError, match="MARLFLOW_WORKFLOWS: module 'no_such_module_xyz' cannot be imported"
    ):
        specs()


# ---------------------------------------------------------------- specs against real episodes


@pytest.mark.slow
@pytest.mark.parametrize("workflow", [*BUILTIN, "debate"])
def test_calls_per_episode_and_slots_match_real_episodes_on_the_toy_model(workflow, debate):
    """Every real episode's role calls are a sub-sequence of the spec's stages (same slots, roles, order),
    has every mandatory slot, and the longest has exactly calls_per_episode calls where an episode cannot
    stop early (Eval-Opt with one round; every workflow's first-stage prompts are identical across rollouts)."""
    from marlflow.generation.hf import ChatEncoder, make_backend
    from marlflow.generation.sampling import Sampling
    from marlflow.models.loading import attach_adapters, load_model_and_tokenizer
    from marlflow.tasks import get_task
    from marlflow.workflows import Context, rollout

    torch.manual_seed(0)
    cfg = cfg_for(workflow, eval_opt_rounds=1 if workflow == "eval_opt" else 0)
    s = spec_of(workflow)
    base, tok = load_model_and_tokenizer(cfg.model)
    model = attach_adapters(cfg, base)
    task = get_task(cfg.task.name)
    ctx = Context(cfg, task.kind, make_backend("hf", model, tok, cfg.policies, cfg),
                  ChatEncoder(tok, cfg.grpo.max_prompt_length), Sampling(1.0, 1.0, 16))  # fmt: skip
    episodes = rollout(cfg, task, task.load("test", cfg.task)[:3], ctx, group_size=2)
    order = [(c.slot, c.role) for stage in s.stages(cfg, task.kind) for c in stage]
    for e in episodes:
        calls = [(c.slot, c.role) for c in e.calls]
        assert calls == [sr for sr in order if sr in calls], (
            workflow,
            calls,
        )  # a sub-sequence, in stage order
        assert {sl for sl, _ in order if s.is_mandatory(sl)} <= {sl for sl, _ in calls}
        assert len(calls) <= s.calls_per_episode(cfg, task.kind)
    longest = max(len(e.calls) for e in episodes)
    if workflow != "orch_workers":  # its workers follow the orchestrator's strategy lines: maybe fewer
        assert longest == s.calls_per_episode(cfg, task.kind)
    for p in range(3):  # first-stage prompts depend on the problem alone
        group = [c for e in episodes[2 * p : 2 * p + 2] for c in e.calls if s.is_first_stage(c.slot)]
        by_slot = {}
        for c in group:
            by_slot.setdefault(c.slot, set()).add(tuple(c.prompt_ids))
        assert by_slot and all(len(v) == 1 for v in by_slot.values())


# ---------------------------------------------------------------- a workflow outside marlflow


@pytest.mark.slow
def test_debate_workflow_trains_a_step_and_aggregates(debate, tmp_path):
    """The debate module is registered through MARLFLOW_WORKFLOWS only: nothing in src/ names it."""
    from marlflow.cli.train import run

    assert not [p for p in (ROOT / "src").rglob("*.py") if '"debate"' in p.read_text()]  # no table names it
    cfg = cfg_for("debate", "ip")
    run_dir = tmp_path / "runs" / cfg.run_id
    run_dir.mkdir(parents=True)
    (run_dir / "config.json").write_text(json.dumps(cfg.to_dict()))
    run(cfg, run_dir)
    m = pd.read_parquet(run_dir / "metrics.parquet")
    train = m[m["split"] == "train"]
    assert set(train["role"]) >= {"debater", "judge"} and train["step"].max() == 1
    ev = m[(m["split"] == "eval") & (m["role"] == "all")]
    assert {"accuracy", "any_correct", "debater_accuracy", "careless_share"} <= set(ev["metric"])
    assert set(ev["step"]) == {0, 1}
    judge = m[(m["split"] == "eval") & (m["role"] == "judge")]
    assert "solution_marker_share" in set(judge["metric"])  # the supervisor, from the spec
    card = (run_dir / "final" / "README.md").read_text()
    assert debate.description in card and "**judge** (adapter `judge`)" in card
    assert sorted(p.name for p in (run_dir / "final").iterdir() if p.is_dir()) == ["debater", "judge"]

    # aggregate as Snakemake runs it: another process, which finds the workflow through the environment
    out = tmp_path / "tables"
    done = subprocess.run([sys.executable, "-m", "marlflow", "aggregate", "--runs", str(run_dir / "metrics.parquet"),
                           "--out", str(out)], capture_output=True, text=True, cwd=ROOT, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    summary = pd.read_csv(out / "summary.csv")
    assert summary["run_id"].tolist() == [cfg.run_id] and summary["workflow"].tolist() == ["debate"]
    grads = pd.read_csv(out / "grad_dynamics.csv")
    assert set(grads["role"]) == {"debater", "judge"}
    assert pd.read_csv(out / "failures.csv")["run_id"].tolist() == [cfg.run_id]

"""The `marlflow` command and what it offers after training: eval, chat and the final/ folder.

One real 2-step toy run (Voting, IP; the test session's offline toy model) is trained once for the module;
eval, chat and final/ are then checked on it through subprocesses, as a user would call them. It trains
on `toy_math_parity`: toy_math's problems and prompts with reward = odd output length, so that GRPO groups
have reward variance and both adapters really move even though the test model is barely warm-started.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch

from marlflow.store.schema import METRIC_COLUMNS, SAMPLE_COLUMNS, VOLATILE_METRICS, validate_metrics
from marlflow.tasks import register
from marlflow.tasks.toy import ToyMath

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
COMMANDS = ["run", "matrix", "models", "train", "eval", "chat", "aggregate", "report", "sandbox"]


@register("toy_math_parity")
class ToyMathParity(ToyMath):
    name = "toy_math_parity"

    def score(self, problems, outputs):
        return [float(len(o) % 2) for o in outputs]


def marlflow(*args, input=None, check=True, cwd=ROOT):
    """Run the console script when it is installed, else the same main() through `python -m`."""
    exe = [str(BIN / "marlflow")] if (BIN / "marlflow").exists() else [sys.executable, "-m", "marlflow"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}
    out = subprocess.run([*exe, *args], cwd=cwd, input=input, capture_output=True, text=True, env=env,
                         timeout=600)  # fmt: skip
    if check:
        assert out.returncode == 0, out.stdout + out.stderr
    return out


def tree_digest(folder: Path, skip: str = "evals") -> dict[str, str]:
    """{relative path: sha256} of every file (and empty folder) under `folder`, except `skip`/."""
    found = {}
    for p in sorted(folder.rglob("*")):
        rel = p.relative_to(folder).as_posix()
        if rel == skip or rel.startswith(skip + "/"):
            continue
        if p.is_file():
            found[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
        elif p.is_dir() and not any(p.iterdir()):
            found[rel + "/"] = "empty"
    return found


@pytest.fixture(scope="module")
def trained_run(toy_model_dir, tmp_path_factory):
    """results/runs/<id>/ of a finished 2-step Voting IP run, as Snakemake leaves it."""
    from marlflow.cli.train import run
    from marlflow.core.config import GRPOParams, RunConfig, TaskSpec

    params = dict(steps=2, problems_per_step=2, group_size=4, learning_rate=2e-2, warmup_steps=0,
                  lr_scheduler="constant", eval_every=1, save_every=1, max_completion_length=12,
                  max_prompt_length=256, lora_r=4, lora_alpha=8)  # fmt: skip
    cfg = RunConfig(run_id="voting-ip-toy-math-s0", workflow="voting", sharing="ip", scale="toy",
                    task_axis="math", seed=0, task=TaskSpec(name="toy_math_parity", eval_size=6, train_size=50),
                    model=str(toy_model_dir), grpo=GRPOParams(**params))  # fmt: skip
    run_dir = tmp_path_factory.mktemp("results") / "runs" / cfg.run_id
    run_dir.mkdir(parents=True)
    (run_dir / "config.json").write_text(json.dumps(cfg.to_dict()))
    run(cfg, run_dir)
    return run_dir, cfg


# ---------------------------------------------------------------- the command


def test_help_lists_every_subcommand():
    out = marlflow("--help")
    for name in COMMANDS:
        assert f"    {name} " in out.stdout or f"    {name}\n" in out.stdout, (name, out.stdout)


def test_subcommands_delegate_to_the_modules():
    sheet = marlflow("matrix", "matrix.yaml", "--preset", "smoke")
    assert "voting-ip-toy-math-s0" in sheet.stdout and sheet.stdout.count("-toy-") == 3
    assert "--run" in marlflow("eval", "--help").stdout  # the module's own help, not the top-level one
    assert "--role" in marlflow("chat", "--help").stdout
    bad = marlflow("evaluate", check=False)
    assert bad.returncode == 2 and "invalid choice: 'evaluate'" in bad.stderr


def test_run_outside_the_repository_says_where_to_run(tmp_path):
    out = marlflow("run", "-n", check=False, cwd=tmp_path)
    assert out.returncode == 2 and "repository root" in out.stderr


def test_pyproject_declares_the_console_script():
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["scripts"]["marlflow"] == "marlflow.cli:main"


# ---------------------------------------------------------------- final/


@pytest.mark.slow
def test_final_folder_loads_with_peft_and_has_a_filled_card(trained_run, toy_model_dir):
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    run_dir, cfg = trained_run
    final = run_dir / "final"
    metrics = pd.read_parquet(run_dir / "metrics.parquet")
    # a local base is named by its absolute folder at export, so the adapters load from any directory
    base_dir = str(Path(toy_model_dir).resolve())
    for policy in cfg.policies:
        conf = json.loads((final / policy / "adapter_config.json").read_text())
        assert conf["base_model_name_or_path"] == base_dir
        base = AutoModelForCausalLM.from_pretrained(conf["base_model_name_or_path"])
        model = PeftModel.from_pretrained(base, final / policy)
        saved = load_file(
            run_dir / "checkpoints" / "step-2" / "adapters" / policy / "adapter_model.safetensors"
        )
        loaded = {k.replace(".default", ""): v for k, v in model.state_dict().items() if "lora_" in k}
        assert len(saved) == len(loaded) > 0
        for key, tensor in saved.items():
            assert torch.equal(loaded[key], tensor), key
        assert any(v.abs().sum() > 0 for k, v in saved.items() if "lora_B" in k)  # trained, not the init
    card = (final / "README.md").read_text()
    # the card's front matter names hub ids only; a local base is in its table
    assert "base_model:" not in card.split("---")[1] and f"| base model | `{base_dir}` |" in card
    assert "| `generator/` | generator |" in card and "| `aggregator/` | aggregator |" in card
    assert "Pick the solution most likely correct" in card and "Solve the problem." in card  # role prompts
    assert "IP" in card and "voting" in card
    acc = metrics[(metrics.split == "eval") & (metrics.role == "all") & (metrics.metric == "accuracy")]
    for step, value in zip(acc.step, acc.value):
        assert f"| {step} | {value:.3f} |" in card
    assert (
        "# Model Card for Model ID" not in (final / "generator" / "README.md").read_text()
    )  # not the template
    assert not (run_dir / ".final.tmp").exists()


# ---------------------------------------------------------------- eval


@pytest.mark.slow
def test_eval_on_the_other_task_writes_its_table_and_leaves_training_outputs_alone(trained_run):
    run_dir, cfg = trained_run
    before = tree_digest(run_dir)
    out = marlflow("eval", "--run", str(run_dir), "--task", "toy_code", "--n", "8")
    assert "accuracy" in out.stdout
    table = run_dir / "evals" / "toy_code-step2.parquet"
    assert str(table) in out.stdout
    df = pd.read_parquet(table)
    assert list(df.columns) == METRIC_COLUMNS
    validate_metrics(df)
    assert set(df.task) == {"code"} and set(df.step) == {2} and set(df.split) == {"eval"}
    assert set(df.run_id) == {cfg.run_id}
    vals = df[df.role == "all"].set_index("metric").value
    assert vals["n_eval"] == 8 and 0 <= vals["accuracy"] <= 1
    assert {"generator", "aggregator"} <= set(df.role)
    samples = pd.read_parquet(run_dir / "evals" / "toy_code-step2-samples.parquet")
    assert list(samples.columns) == SAMPLE_COLUMNS and len(samples) > 0
    assert samples.prompt.str.contains("```python").any()  # code prompts: the toy_code task was used
    assert tree_digest(run_dir) == before  # nothing outside evals/ was written, no trl/ folder either


@pytest.mark.slow
def test_eval_on_another_task_uses_that_tasks_completion_budget(trained_run):
    """The run trained toy_math-style with 12 tokens; toy_code needs the 40 that matrix.yaml gives it (before,
    eval kept the source run's budget, cut every code answer off and printed accuracy 0.000)."""
    run_dir, cfg = trained_run
    assert cfg.grpo.max_completion_length == 12
    marlflow("eval", "--run", str(run_dir), "--task", "toy_code", "--n", "4", "--step", "0")
    summary = json.loads((run_dir / "evals" / "toy_code-step0.json").read_text())
    assert summary["max_new_tokens"] == 40 and "presets.toy" in summary["max_new_tokens_from"], summary
    df = pd.read_parquet(run_dir / "evals" / "toy_code-step0.parquet")
    assert df[(df.role == "all") & (df.metric == "max_new_tokens")].value.tolist() == [40.0]
    # the run's own task keeps the run's own budget (toy_math_parity is registered in this process only)
    from marlflow.cli.evaluate import task_budget

    assert task_budget(cfg, cfg.task.name, run_dir)[0] == 12


@pytest.mark.slow
def test_eval_warns_when_answers_hit_the_budget(trained_run):
    run_dir, _ = trained_run
    out = marlflow("eval", "--run", str(run_dir), "--task", "toy_code", "--n", "4", "--step", "0",
                   "--max-new-tokens", "3")  # fmt: skip
    summary = json.loads((run_dir / "evals" / "toy_code-step0.json").read_text())
    assert summary["max_new_tokens"] == 3 and summary["max_new_tokens_from"] == "--max-new-tokens"
    assert (
        summary["truncated_share"] > 0.05
        and "hit the completion budget of 3 tokens" in summary["warnings"][0]
    )
    assert "warning:" in out.stderr and "--max-new-tokens" in out.stderr, out.stderr
    assert "WARNING" in out.stdout
    df = pd.read_parquet(run_dir / "evals" / "toy_code-step0.parquet")
    assert (
        df[(df.role == "all") & (df.metric == "truncated_share")].value.iloc[0] == summary["truncated_share"]
    )
    bad = marlflow("eval", "--run", str(run_dir), "--max-new-tokens", "0", check=False)
    assert bad.returncode == 2 and "--max-new-tokens must be >= 1" in bad.stderr


def test_eval_of_the_runs_own_task_reproduces_the_training_evaluation(trained_run):
    """Same adapters, same seeded sampling stream, same code path: the step-2 numbers come back exactly
    (all but the wall-clock timings)."""
    from marlflow.cli.evaluate import EVAL_ONLY_METRICS, evaluate_run

    run_dir, _ = trained_run
    path, df = evaluate_run(run_dir, step=2)
    df = df[~df.metric.isin(VOLATILE_METRICS) & ~((df.role == "all") & df.metric.isin(EVAL_ONLY_METRICS))]
    train = pd.read_parquet(run_dir / "metrics.parquet")
    train = train[(train.split == "eval") & (train.step == 2) & ~train.metric.isin(VOLATILE_METRICS)]
    assert "time_eval" in set(pd.read_parquet(run_dir / "metrics.parquet").metric)
    key = ["role", "metric"]
    pd.testing.assert_frame_equal(
        df.sort_values(key).reset_index(drop=True)[METRIC_COLUMNS],
        validate_metrics(train).sort_values(key).reset_index(drop=True),
    )
    ours = pd.read_parquet(path.with_name("toy_math_parity-step2-samples.parquet"))
    theirs = pd.read_parquet(run_dir / "samples.parquet")
    theirs = theirs[theirs.step == 2].reset_index(drop=True)
    assert ours.output.tolist() == theirs.output.tolist() and len(ours) > 0


def test_eval_step_zero_is_the_base_workflow(trained_run):
    from marlflow.cli.evaluate import evaluate_run

    run_dir, _ = trained_run
    _, df = evaluate_run(run_dir, step=0)
    train = pd.read_parquet(run_dir / "metrics.parquet")
    base = (
        train[(train.split == "eval") & (train.step == 0) & (train.role == "all")].set_index("metric").value
    )
    ours = df[df.role == "all"].set_index("metric").value
    assert ours["careless_share"] == base["careless_share"] and ours["accuracy"] == base["accuracy"]


@pytest.mark.parametrize(
    "args,message",
    [
        (["--step", "7"], "no complete checkpoint for step 7; available steps: 1, 2"),
        (["--task", "toy_cod"], "task 'toy_cod' is not registered"),
        (["--n", "0"], "--n must be >= 1"),
    ],
)
def test_eval_bad_input_names_the_fix(trained_run, args, message):
    run_dir, _ = trained_run
    out = marlflow("eval", "--run", str(run_dir), *args, check=False)
    assert out.returncode == 2 and message in out.stderr, out.stderr
    assert "Traceback" not in out.stderr


def test_eval_of_a_folder_that_is_not_a_run(tmp_path):
    out = marlflow("eval", "--run", str(tmp_path), check=False)
    assert out.returncode == 2 and "config.json not found" in out.stderr and "Traceback" not in out.stderr


# ---------------------------------------------------------------- chat


@pytest.mark.slow
def test_chat_answers_piped_lines_with_the_roles_adapter(trained_run):
    """Two piped lines get two replies, equal to greedy generation with the generator's final adapter
    loaded independently through PEFT and the chat template."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from marlflow.models.runs import run_root
    from marlflow.workflows import prompts

    run_dir, cfg = trained_run
    problems = ["7+5-3", "4*2+9"]
    out = marlflow("chat", "--run", str(run_dir), "--role", "generator", input="\n".join(problems) + "\n")
    replies = [line for line in out.stdout.splitlines() if line.startswith("generator> ")]
    assert len(replies) == 2, out.stdout
    folder = run_dir / "final" / "generator"
    base_id = json.loads((folder / "adapter_config.json").read_text())["base_model_name_or_path"]
    # The adapter names its base relative to the root that holds results/ (runs.base_model_id), as PEFT reads
    # it when loaded from that root; this test runs elsewhere, so it joins the two.
    base_id = str(run_root(run_dir) / base_id)
    tok = AutoTokenizer.from_pretrained(base_id)
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_id), folder).eval()
    for problem, reply in zip(problems, replies):
        ids = tok.apply_chat_template(prompts.solve("math", problem), add_generation_prompt=True, tokenize=True,
                                      return_dict=True, return_tensors="pt")  # fmt: skip
        gen = model.generate(**ids, do_sample=False, max_new_tokens=cfg.grpo.max_completion_length,
                             pad_token_id=tok.pad_token_id)  # fmt: skip
        expected = tok.decode(gen[0, ids["input_ids"].shape[1] :], skip_special_tokens=True).strip()
        assert reply == f"generator> {expected}"


def test_chat_unknown_role_lists_the_workflows_roles(trained_run):
    run_dir, _ = trained_run
    out = marlflow("chat", "--run", str(run_dir), "--role", "evaluator", input="1+1\n", check=False)
    assert out.returncode == 2 and "choose one of generator, aggregator" in out.stderr

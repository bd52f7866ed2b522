"""The `final/` folder of a finished run: its adapters in PEFT format plus a filled model card.

`python -m marlflow train` calls `write_final(run_dir, cfg, metrics)` after training. It copies the adapters
of the newest complete checkpoint (the last step) into

    RUN/final/<policy>/adapter_config.json, adapter_model.safetensors, README.md   (SP: shared; IP: one per role type)
    RUN/final/README.md                                                             the model card

with `base_model_name_or_path` set to the base chosen at export: a hub id, or the absolute path of the local base
folder as resolved when final/ is written (`marlflow.models.runs.base_model_id`; `write_final(..., base=...)`
records another), so that from any working directory

    from peft import AutoPeftModelForCausalLM, PeftModel
    model = AutoPeftModelForCausalLM.from_pretrained("/abs/path/results/runs/<run_id>/final/<policy>")
    model = PeftModel.from_pretrained(base_model, "results/runs/<run_id>/final/<policy>")

works. The card's front matter is valid Hugging Face metadata: `base_model:` holds a hub id, and is left out for a
local base (its path is in the card's table instead; a path is not a valid `base_model`). The card names the base model, the roles, which adapter each uses and its prompt, the workflow,
the sharing, the main GRPO settings and the eval curve's numbers. The folder is built under a temp name
and renamed into place, so a killed job leaves the previous final/ or none.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pandas as pd

from marlflow.core.config import RunConfig
from marlflow.core.workflow_spec import spec_of
from marlflow.models.runs import adapter_dir, base_model_id, find_checkpoint, is_hub_id, set_base_model
from marlflow.store.atomic import atomic_write_text
from marlflow.tasks import get_task
from marlflow.tasks.solution_metrics import metric_names as solution_metric_names


def role_prompts(cfg: RunConfig) -> dict[str, list[str]]:
    """Each role type's prompt(s) as the workflow writes them, with placeholders in braces (its WorkflowSpec)."""
    templates = spec_of(cfg.workflow).prompt_templates(cfg)
    return {r: templates[r] for r in cfg.role_types}


def eval_curve(metrics: pd.DataFrame, extra: tuple[str, ...] = ()) -> pd.DataFrame:
    """step, accuracy, accuracy_se, n_eval (and the metrics `extra` names, where logged) of the workflow's
    evaluations."""
    ev = metrics[(metrics.split == "eval") & (metrics.role == "all")]
    wide = ev.pivot_table(index="step", columns="metric", values="value", aggfunc="last")
    cols = [c for c in ("accuracy", "accuracy_se", "n_eval", *extra) if c in wide.columns]
    return wide[cols].reset_index()


def _md_table(df: pd.DataFrame) -> str:
    def cell(col, v):
        return str(int(v)) if col in ("step", "n_eval") else f"{v:.3f}"

    head = "| " + " | ".join(df.columns) + " |\n|" + "---|" * len(df.columns) + "\n"
    body = (
        "| " + " | ".join(cell(c, v) for c, v in zip(df.columns, row)) + " |\n"
        for row in df.itertuples(index=False)
    )
    return head + "".join(body)


def _use_lines(cfg: RunConfig, base: str, target: str, roles_of: dict[str, list[str]]) -> list[str]:
    """The model card's "Use" section: loading the adapter folder `target` with PEFT, and the chat command."""
    agent = roles_of[cfg.policies[0]][0] if cfg.sharing == "agent" else ""
    chat_agent = (
        f" --agent {agent}" if agent and spec_of(cfg.workflow).parallel_role == cfg.role_types[0] else ""
    )
    load = (
        [f'model = AutoModelForCausalLM.from_pretrained("results/runs/{cfg.run_id}/{target}")']
        if cfg.adapter == "full"
        else ["from peft import PeftModel", f'base = AutoModelForCausalLM.from_pretrained("{base}")',
              f'model = PeftModel.from_pretrained(base, "results/runs/{cfg.run_id}/{target}")']
    )  # fmt: skip
    return [
        "## Use",
        "",
        "```python",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        f'tok = AutoTokenizer.from_pretrained("{base}")',
        *load,
        "```",
        "",
        f"Or: `marlflow chat --run results/runs/{cfg.run_id} --role {cfg.role_types[0]}{chat_agent}`, and "
        f"`marlflow eval --run results/runs/{cfg.run_id} --task <task>` for another task.",
        "",
    ]


def model_card(
    cfg: RunConfig, base: str, step: int, metrics: pd.DataFrame | None, policy: str | None = None
) -> str:
    """The README.md of final/ (policy None) or of one adapter folder in it."""
    g = cfg.grpo
    # base_model: a hub id only; the card metadata allows nothing else (a local base is named in the table below)
    hub = [f"base_model: {json.dumps(base)}"] if is_hub_id(base) else []
    full = cfg.adapter == "full"
    lines = ["---", *hub, f"library_name: {'transformers' if full else 'peft'}", "pipeline_tag: text-generation",
             "tags:", "- marlflow", "- grpo", f"- {'full-fine-tuning' if full else 'lora'}", "- multi-agent",
             f"- {cfg.workflow}", "---", ""]  # fmt: skip
    title = f"marlflow run `{cfg.run_id}`" + (f", adapter `{policy}`" if policy else "")
    roles_of = cfg.policy_members()
    lines += [
        f"# {title}",
        "",
        f"{'Fully fine-tuned models, one per policy,' if full else 'LoRA adapters'} trained with multi-agent GRPO "
        f"by marlflow (step {step} of {g.steps}).",
        "",
        "| | |",
        "|---|---|",
        f"| base model | `{base}` |",
        f"| workflow | {cfg.workflow}: {spec_of(cfg.workflow).description} |",
        f"| sharing | {cfg.sharing.upper()}: "
        + (
            "one adapter, `shared`, trained by every role |"
            if cfg.sharing == "sp"
            else "one adapter per role type |"
            if cfg.sharing == "ip"
            else f"one adapter per agent instance (each {spec_of(cfg.workflow).parallel_role} its own) |"
        ),
        f"| task | {cfg.task.name} ({cfg.task_axis}), {cfg.task.eval_size} held-out problems per evaluation |",
        f"| scale / seed / preset | {cfg.scale} / {cfg.seed} / {cfg.preset} |",
        f"| GRPO | {g.steps} steps, {g.problems_per_step} problems x G={g.group_size} per step, lr {g.learning_rate:g} "
        f"({g.lr_scheduler}, {g.warmup_steps} warm-up), loss {g.loss_type}, clip {g.epsilon:g}/{g.epsilon_high:g}, "
        f"beta {g.beta:g}, rollout temperature {g.temperature:g}, eval temperature {g.eval_temperature:g} |",
        "| adapter | full fine-tuning: every parameter, one model per policy |"
        if full
        else f"| LoRA | r={g.lora_r}, alpha={g.lora_alpha}, targets {g.lora_targets} |",
        "",
        "## Adapters and roles",
        "",
        "| adapter folder | roles (agents) |",
        "|---|---|",
        *[f"| `{p}/` | {', '.join(rs)} |" for p, rs in roles_of.items()],
        "",
        "## Role prompts",
        "",
        "User messages as the workflow writes them (placeholders in braces), sent through the base model's chat "
        "template.",
        "",
    ]
    for role, texts in role_prompts(cfg).items():
        for text in texts:
            adapters = cfg.role_policies()[role]
            lines += [f"**{role}** (adapter{'s' if len(adapters) > 1 else ''} "
                      f"{', '.join(f'`{a}`' for a in adapters)}):", "", "```text", text, "```", ""]  # fmt: skip
    lines += ["## Evaluation curve", ""]
    if metrics is not None and len(metrics):
        # the task's own metrics of its solutions (toy tasks: careless_share), marlflow.tasks.solution_metrics
        curve = eval_curve(metrics, solution_metric_names(get_task(cfg.task.name)))
        lines += [
            f"Workflow accuracy on the first {cfg.task.eval_size} test problems of {cfg.task.name}, one episode "
            "per problem; accuracy_se = sqrt(p(1-p)/n).",
            "",
            _md_table(curve),
        ]
    else:
        lines += ["No metrics were recorded.", ""]
    lines += _use_lines(cfg, base, f"final/{policy or cfg.policies[0]}", roles_of)
    return "\n".join(lines)


def write_final(
    run_dir: str | Path, cfg: RunConfig, metrics: pd.DataFrame | None = None, base: str | None = None
) -> Path:
    """Build RUN/final from the newest complete checkpoint; returns the folder. metrics: the run's table
    (read from RUN/metrics.parquet when None). base: what the adapters name as their base (default: the hub id,
    or the local base folder's absolute path, `base_model_id`)."""
    run_dir = Path(run_dir)
    step, ckpt = find_checkpoint(run_dir)
    if metrics is None and (run_dir / "metrics.parquet").exists():
        metrics = pd.read_parquet(run_dir / "metrics.parquet")
    base = base or base_model_id(cfg, run_dir)
    final, tmp = run_dir / "final", run_dir / ".final.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        for policy in cfg.policies:
            src, dst = adapter_dir(ckpt, policy), tmp / policy
            if cfg.adapter == "full":  # the policy's whole model: a transformers folder (config, weights)
                shutil.copytree(src, dst)
            else:
                dst.mkdir(parents=True)
                shutil.copy2(src / "adapter_model.safetensors", dst / "adapter_model.safetensors")
                shutil.copy2(src / "adapter_config.json", dst / "adapter_config.json")
                set_base_model(dst, base)
            atomic_write_text(dst / "README.md", model_card(cfg, base, step, metrics, policy))
        atomic_write_text(tmp / "README.md", model_card(cfg, base, step, metrics))
        old = run_dir / ".final.old"
        shutil.rmtree(old, ignore_errors=True)
        if final.exists():
            final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final

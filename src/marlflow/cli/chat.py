"""Talk to one role of a trained run: `marlflow chat --run results/runs/<run_id> --role R [--step N]`.

Loads the run's base model and the adapters of checkpoint step N (default: the newest; 0 is the base
model), activates the adapter that role R trains (SP: the shared one; IP: R's own; agent: the parallel role's
agent named by `--agent generator1`, any other role's own) and answers every line
read from standard input with R's reply, one `R> reply` line each. Interactive on a terminal, scriptable
through a pipe (`printf '3+4\\n' | marlflow chat ...`).

Each line is one independent request. For the roles whose prompt is built from the problem alone
(generator, orchestrator) the line is the problem and goes into that role's prompt exactly as the
workflow writes it, so the model sees what it was trained on; other roles (evaluator, aggregator, worker,
synthesizer) are prompted with context from the workflow, so their line is sent as the whole user message.
`--raw` sends every line as is. Either way it goes through the tokenizer's chat template.
"""

from __future__ import annotations

import argparse
import sys

from marlflow.core.config import ConfigError
from marlflow.core.workflow_spec import spec_of
from marlflow.models.runs import RunError, find_checkpoint, load_policy_model, load_run


def messages_for(cfg, role: str, line: str, raw: bool = False) -> list[dict]:
    """The chat messages role `role` gets for one input line (the roles whose prompt needs only the problem
    text: the workflow's WorkflowSpec.problem_prompts)."""
    build = spec_of(cfg.workflow).problem_prompts.get(role)
    if not raw and build is not None:
        return build(cfg, cfg.task_axis, line)
    return [{"role": "user", "content": line}]


def chat(run_dir, role: str, lines, out, step: int | None = None, raw: bool = False,
         temperature: float = 0.0, max_new_tokens: int | None = None, prompt=None, agent: str | None = None) -> int:  # fmt: skip
    """Answer each line of `lines` as `role`; write `role> reply` lines to `out`. Returns replies written."""
    from marlflow.generation.hf import ChatEncoder, HFBackend, Sampling

    cfg = load_run(run_dir)
    if role not in cfg.role_types:
        raise RunError(
            f"role {role!r} is not a role of workflow {cfg.workflow}; choose one of {', '.join(cfg.role_types)}"
        )
    members = cfg.policy_members()
    spec = spec_of(cfg.workflow)
    agents = [m for ms in members.values() for m in ms if spec.is_parallel_slot(role, m)]
    if agent is not None and agent not in agents:
        raise RunError(f"--agent {agent!r} is not an agent of role {role} under sharing {cfg.sharing}"
                       + (f"; choose one of {', '.join(agents)}" if agents else "; leave --agent out"))  # fmt: skip
    if agents and agent is None:
        raise RunError(f"under sharing agent each {role} has its own adapter: name one with --agent "
                       f"({', '.join(agents)})")  # fmt: skip
    step, ckpt = find_checkpoint(run_dir, step)
    model, tok = load_policy_model(cfg, run_dir, ckpt)
    policy = cfg.policy_of(role, agent)
    encoder = ChatEncoder(tok, cfg.grpo.max_prompt_length)
    backend = HFBackend(model, tok, cfg.policies, fast=cfg.fastgen)
    sampling = Sampling(temperature, cfg.grpo.top_p, max_new_tokens or cfg.grpo.max_completion_length)
    print(f"{cfg.run_id} step {step}, role {role} (adapter {policy}); one request per line, Ctrl-D ends",
          file=sys.stderr)  # fmt: skip
    n = 0
    if prompt:
        prompt()
    for line in lines:
        line = line.rstrip("\n")
        if line.strip():
            ids = backend.generate(policy, [encoder(messages_for(cfg, role, line, raw))], sampling)[0]
            reply = tok.decode(ids, skip_special_tokens=True).strip()
            print(f"{role}> {reply}", file=out, flush=True)
            n += 1
        if prompt:
            prompt()
    return n


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="marlflow chat", description=__doc__.splitlines()[0])
    ap.add_argument("--run", required=True, help="run folder, e.g. results/runs/voting-ip-toy-math-s0")
    ap.add_argument("--role", required=True, help="role to talk to, e.g. generator, aggregator, evaluator")
    ap.add_argument("--agent", help="under sharing agent: which agent of a parallel role, e.g. generator1")
    ap.add_argument("--step", type=int, help="checkpoint step (default: the newest; 0: the untrained base)")
    ap.add_argument("--raw", action="store_true", help="send each line as is, not inside the role's prompt")
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    ap.add_argument("--max-new-tokens", type=int, help="default: the run's max_completion_length")
    args = ap.parse_args(argv)
    if args.temperature < 0:
        ap.error("--temperature must be >= 0")
    interactive = sys.stdin.isatty()

    def prompt():
        if interactive:
            print("> ", end="", file=sys.stderr, flush=True)

    try:
        chat(args.run, args.role, sys.stdin, sys.stdout, args.step, args.raw, args.temperature,
             args.max_new_tokens, prompt, args.agent)  # fmt: skip
    except (RunError, ConfigError) as err:
        print(f"marlflow chat: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())

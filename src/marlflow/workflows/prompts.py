"""Role prompts (our own text) for every workflow, as chat messages.

The role structure follows arXiv 2605.24202 (docs/paper-setup.md section 5); the wording is ours.
Each builder returns a list of `{"role": ..., "content": ...}` messages; the generation backend applies
the model's chat template. The toy model's warm start (`marlflow.models.loading`) is trained on exactly these
messages, so changing a prompt means rebuilding the toy model (Snakemake does, because the model rule
depends on the package version of this file's text through `PROMPT_VERSION`).
"""

from __future__ import annotations

PROMPT_VERSION = 1

_ANSWER = {
    "math": "Put the final answer in \\boxed{}.",
    "code": "Answer with one ```python code block.",
}


def _msg(role: str, content: str) -> dict:
    return {"role": role, "content": content}


def solve(kind: str, problem: str) -> list[dict]:
    """Generator (single, Eval-Opt, Voting): solve the problem."""
    return [_msg("user", f"Solve the problem. {_ANSWER[kind]}\nProblem: {problem}")]


def evaluate(kind: str, problem: str, history: list[dict]) -> list[dict]:
    """Evaluator: judges the last generator turn in the shared conversation history."""
    what = "code" if kind == "code" else "solution"
    return [
        *history,
        _msg(
            "user",
            f"Check the {what} above. Reply \\boxed{{Correct}} or \\boxed{{Incorrect}} and, if incorrect, "
            "say briefly what is wrong. Do not give the answer.",
        ),
    ]


def refine(kind: str, history: list[dict]) -> list[dict]:
    """Generator refinement after an Incorrect verdict; the critique is the last assistant turn."""
    return [*history, _msg("user", f"Write a new solution that fixes the issues. {_ANSWER[kind]}")]


def _numbered(solutions: list[str]) -> str:
    return "\n".join(f"--- Solution {i} ---\n{s}" for i, s in enumerate(solutions, 1))


def aggregate(kind: str, problem: str, solutions: list[str]) -> list[dict]:
    """Voting aggregator: picks one candidate by number."""
    return [
        _msg(
            "user",
            f"Pick the solution most likely correct. Answer \\boxed{{N}} with its number.\nProblem: {problem}\n"
            f"{_numbered(solutions)}",
        )
    ]


def orchestrate(kind: str, problem: str, n: int) -> list[dict]:
    """Orchestrator: proposes up to n strategies, one `STRATEGY k:` line each, without solving."""
    return [
        _msg(
            "user",
            f"Propose up to {n} different strategies, one line each as STRATEGY k: ... Do not solve it.\n"
            f"Problem: {problem}",
        )
    ]


def work(kind: str, problem: str, strategy: str) -> list[dict]:
    """Worker: solves the whole problem with one assigned strategy."""
    return [
        _msg("user", f"Solve the problem with the strategy: {strategy}. {_ANSWER[kind]}\nProblem: {problem}")
    ]


def synthesize(kind: str, problem: str, solutions: list[str]) -> list[dict]:
    """Synthesizer: compares worker solutions (agreement = confidence) and gives the final answer."""
    return [
        _msg(
            "user",
            f"Compare the solutions; agreement means confidence. Give the final answer. {_ANSWER[kind]}\n"
            f"Problem: {problem}\n{_numbered(solutions)}",
        )
    ]

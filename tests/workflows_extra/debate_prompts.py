"""Prompts of the test-only debate workflow (tests/workflows_extra/debate.py), as chat messages.

Our own text, in the manner of marlflow.workflows.prompts: each builder returns `{"role", "content"}`
messages that the generation backend puts through the model's chat template.
"""

from __future__ import annotations

_ANSWER = {
    "math": "Put the final answer in \\boxed{}.",
    "code": "Answer with one ```python code block.",
}


def open_round(kind: str, problem: str) -> list[dict]:
    """Debater, round 1: solve the problem on its own."""
    return [{"role": "user", "content": f"Solve the problem. {_ANSWER[kind]}\nProblem: {problem}"}]


def rebut(kind: str, problem: str, own: str, other: str) -> list[dict]:
    """Debater, round 2: its own answer and the other debater's, then a revised answer."""
    return [
        {
            "role": "user",
            "content": f"Problem: {problem}\nYour answer:\n{own}\nThe other debater's answer:\n{other}\n"
            f"Check both and give your final answer. {_ANSWER[kind]}",
        }
    ]


def judge(kind: str, problem: str, answers: list[str]) -> list[dict]:
    """Judge: picks the better of the debaters' final answers by number."""
    listed = "\n".join(f"Answer {i}:\n{a}" for i, a in enumerate(answers, 1))
    return [
        {
            "role": "user",
            "content": f"Problem: {problem}\n{listed}\nWhich answer is right? Reply \\boxed{{N}} with its number.",
        }
    ]

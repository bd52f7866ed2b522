"""Code tasks (mbpp, humaneval, deepcoder): loaders for hub ids or local files; rewards from the sandbox.

The program is the last fenced Python block of a model output (else the whole output); the reward is
1.0 only if every test passes in `marlflow.sandbox` (run in parallel through `verify_many`).

- mbpp: google-research-datasets/mbpp (full); task-id splits test 11-510, validation 511-600,
  train 601-974, prompt 1-10. Tests = test_setup_code + the three asserts; the prompt shows them.
- humaneval: openai/openai_humaneval (test only). The program is the HumanEval prompt followed by the
  model's code (a full function or just its body); tests = `test` + `check(entry_point)`.
- deepcoder: agentica-org/DeepCoder-Preview-Dataset, subset primeintellect; with `task.runtime_results`
  only the tests a reference solution passed are kept (the paper's filter, marlflow.tasks.deepcoder_runtime);
  problems without tests are dropped, then shuffle(seed=42) and the first 1,000 are the test split. stdin/stdout tests become
  sandbox stdio cases (`marlflow.sandbox.stdio_tests`); function-call tests become sandbox call cases
  (`marlflow.sandbox.CALLS_MARKER`): arguments go to the program, expected values never do.

    task = get_task("mbpp"); problems = task.load("test", TaskSpec(name="mbpp", source="data/mbpp/mbpp.jsonl"))
    task.score(problems, outputs)
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from marlflow import sandbox
from marlflow.tasks import Problem, register
from marlflow.tasks.datasets import DataError, cap, check_split, field, nonempty, source_rows, split_records

_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)(?:```|\Z)", re.S)


def extract_code(text: str | None) -> str | None:
    """The last fenced ```python (or untagged) block; else the whole text; None for empty text."""
    if text is None or not text.strip():
        return None
    blocks = _FENCE.findall(text)
    py = [body for lang, body in blocks if lang.lower() in ("python", "py", "python3", "")]
    if py:
        return py[-1].rstrip() + "\n"
    if blocks:  # only other-language blocks: not a Python answer
        return blocks[-1][1].rstrip() + "\n"
    return text.strip("\n").rstrip() + "\n"


class CodeTask:
    kind = "code"
    name = ""
    timeout = 5.0  # seconds per program (per stdio case for deepcoder)
    memory_mb = 1024

    def extract(self, text: str) -> str | None:
        return extract_code(text)

    def program(self, problem: Problem, code: str) -> str:
        return code

    def job(self, problem: Problem, code: str) -> dict:
        """The sandbox job for one answer. Asserts become (call, expected) pairs judged in this process;
        other tests run in the sandbox's judge process, where `prelude` (trusted code such as the HumanEval
        prompt's helpers) is defined and `entry_point` is the only name that reaches the program."""
        job = {"code": self.program(problem, code), "tests": problem.tests}
        if problem.entry_point:
            job["entry_point"] = problem.entry_point
        if problem.meta.get("prefix"):
            job["prelude"] = problem.meta["prefix"]
        return job

    def warm_up(self) -> None:
        """Start the sandbox pool and check that it passes a trivial program, before the first evaluation: a
        sandbox that cannot run fails the run at start, and starting it is not timed as evaluation."""
        r = sandbox.verify_many(
            [("def f():\n    return 1\n", "assert f() == 1\n")],
            timeout=self.timeout,
            memory_mb=self.memory_mb,
            cache=False,
        )[0]
        if not r.passed:
            raise RuntimeError(f"the code sandbox failed a trivial program ({r.status}: {r.detail})")

    def score(self, problems: Sequence[Problem], outputs: Sequence[str]) -> list[float]:
        """1.0 per output whose program passes its problem's tests, else 0.0. No output can make this raise:
        whatever goes wrong judging one program is its verdict (`error`, `crashed`, ...: reward 0). Only a
        malformed problem (empty tests) or a sandbox that cannot start raises (ValueError, SandboxUnavailable)."""
        if len(problems) != len(outputs):
            raise ValueError(f"{len(problems)} problems but {len(outputs)} outputs")
        jobs, idx = [], []
        for i, (p, out) in enumerate(zip(problems, outputs)):
            code = self.extract(out)
            if code is not None:
                jobs.append(self.job(p, code))
                idx.append(i)
        rewards = [0.0] * len(problems)
        for i, r in zip(idx, sandbox.verify_many(jobs, timeout=self.timeout, memory_mb=self.memory_mb)):
            rewards[i] = 1.0 if r.passed else 0.0
        return rewards


MBPP_SPLITS = {"prompt": (1, 10), "test": (11, 510), "validation": (511, 600), "train": (601, 974)}


@register("mbpp")
class MBPP(CodeTask):
    name = "mbpp"
    timeout = 10.0  # the slowest reference (task 123) needs ~5 CPU-seconds
    hub_id, hub_config = "google-research-datasets/mbpp", "full"

    def load(self, split: str, spec=None) -> list[Problem]:
        check_split(split)
        rows, is_split = source_rows(spec, split, self.hub_id, self.hub_config, split)
        lo, hi = MBPP_SPLITS[split]
        ids = [field(rows, i, "task_id", "int") for i in range(len(rows))]
        order = sorted((i for i in range(len(rows)) if is_split or lo <= ids[i] <= hi), key=lambda i: ids[i])
        out = []
        for i in order:
            asserts = field(rows, i, "test_list", "text_list")
            setup = field(rows, i, "test_setup_code", required=False, default="").strip()
            tests = (setup + "\n" if setup else "") + "\n".join(asserts) + "\n"
            text = field(rows, i, "text", required=False) or field(
                rows, i, "prompt", required=False, default=""
            )
            prompt = f"{text}\nYour code should pass these tests:\n\n" + "\n".join(asserts)
            out.append(
                Problem(
                    f"mbpp/{ids[i]}",
                    "mbpp",
                    "code",
                    prompt,
                    field(rows, i, "code"),
                    tests=tests,
                    meta={"task_id": ids[i]},
                )
            )
        return nonempty(cap(out, spec, split), self.name, split)


@register("humaneval")
class HumanEval(CodeTask):
    name = "humaneval"
    hub_id = "openai/openai_humaneval"

    def load(self, split: str, spec=None) -> list[Problem]:
        check_split(split)
        if split == "train" and not (spec is not None and spec.train_file):
            raise ValueError(
                "humaneval has only a test split (164 problems); train on mbpp or set task.train_file"
            )
        rows, _ = source_rows(spec, split, self.hub_id, None, "test")
        items = []
        for i in range(len(rows)):
            tid, prompt = field(rows, i, "task_id"), field(rows, i, "prompt")
            num = tid.rsplit("/", 1)[-1]
            if not num.isdigit():
                raise DataError(
                    f"{rows.where(i)}: field 'task_id' is {tid!r}; it must look like 'HumanEval/12'"
                )
            sol, test, entry = (field(rows, i, k) for k in ("canonical_solution", "test", "entry_point"))
            items.append(
                (
                    int(num),
                    Problem(
                        tid,
                        "humaneval",
                        "code",
                        prompt,
                        prompt + sol,
                        tests=f"{test}\n\ncheck({entry})\n",
                        entry_point=entry,
                        meta={"prefix": prompt},
                    ),
                )
            )
        out = [p for _, p in sorted(items, key=lambda it: it[0])]
        return nonempty(cap(out, spec, split), self.name, split)

    def program(self, problem: Problem, code: str) -> str:
        # The prompt carries imports and helpers that tests use; the model may answer with the whole
        # function (it replaces the stub) or with only the indented body.
        first = next((ln for ln in code.splitlines() if ln.strip()), "")
        prefix = problem.meta.get("prefix", "")
        return prefix + code if first[:1] in (" ", "\t") else prefix + "\n\n" + code


@register("deepcoder")
class DeepCoder(CodeTask):
    name = "deepcoder"
    hub_id, hub_config = "agentica-org/DeepCoder-Preview-Dataset", "primeintellect"
    timeout = 6.0
    memory_mb = 2048
    test_count = 1000

    def load(self, split: str, spec=None) -> list[Problem]:
        """The paper's filtering (marlflow.tasks.deepcoder_runtime): with `task.runtime_results`, only the
        tests a reference solution passed are kept; problems left without tests are dropped; then
        shuffle(seed=42) and the first `task.test_size` (default 1,000) problems are the test split."""
        from marlflow.tasks import deepcoder_runtime as rt

        check_split(split)
        rows, is_split = source_rows(spec, split, self.hub_id, self.hub_config, "train")
        results_file = getattr(spec, "runtime_results", "") if spec is not None else ""
        if results_file and is_split:
            raise DataError(
                "task.runtime_results indexes the whole primeintellect train split, so it needs task.source "
                "(the hub id or one local file), not task.train_file/test_file or a folder of splits"
            )
        where = rows.where if hasattr(rows, "where") else (lambda i: f"row {i + 1}")
        parsed = []
        for i in range(len(rows)):
            field(rows, i, "problem")  # a row that is not an object, or has no problem text, fails here
            parsed.append(rt.parse_tests(rows[i].get("tests"), where(i)))
        results = rt.load_results(results_file, rows, parsed) if results_file else {}
        problems = []
        for i, tests_i in enumerate(parsed):
            kept = rt.keep_passed(tests_i, results.get(i)) if results_file else tests_i
            try:
                tests = rt.deepcoder_tests(kept) if kept else ""
            except (ValueError, TypeError, KeyError) as err:
                raise DataError(
                    f"{where(i)}: field 'tests' cannot be turned into sandbox tests ({err!r})"
                ) from None
            if not tests:
                continue
            sols = rt.solutions_of(rows[i])
            problems.append(
                Problem(
                    "",
                    "deepcoder",
                    "code",
                    rows[i]["problem"],
                    sols[0] if sols else "",
                    tests=tests,
                    meta={"row": i, "tests": len(kept)},
                )
            )
        if not is_split:
            n_test = (getattr(spec, "test_size", 0) if spec is not None else 0) or self.test_count
            train, test = split_records(problems, n_test, seed=42, shuffle_only=True)
            problems = train if split == "train" else test
        out = [Problem(f"deepcoder/{p.meta['row']}", *_fields(p)) for p in problems]
        return nonempty(cap(out, spec, split), self.name, split)


def _fields(p: Problem) -> tuple:
    return (p.task, p.kind, p.prompt, p.answer, p.tests, p.entry_point, p.meta)

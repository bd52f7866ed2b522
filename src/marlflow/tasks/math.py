"""Math tasks (gsm8k, math, dapo_math) and their answer checking.

Answers are the content of the last `\\boxed{...}` (nested braces handled). GSM8K answers are compared
as numbers (commas, units, `$`, trailing `.0` handled); MATH and DAPO answers with math-verify, which runs
in helper processes (marlflow.tasks.verifier) so that `math_equal(pred, gold, timeout=...)` works from any
thread. Datasets (hub ids or local files) are read by marlflow.tasks.datasets.

    from marlflow.tasks import get_task
    task = get_task("math")                      # MATH train (12k) / MATH-500 test
    problems = task.load("test", TaskSpec(name="math", source="data/math"))
    task.score(problems, outputs)                 # [1.0, 0.0, ...]
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from fractions import Fraction

from marlflow.tasks import Problem, register
from marlflow.tasks.datasets import cap, check_split, field, nonempty, source_rows, split_records
from marlflow.tasks.verifier import verify

# --------------------------------------------------------------------------------------------------
# Answer extraction and checking


def last_boxed(text: str | None) -> str | None:
    """Content of the last \\boxed{...} (or \\fbox{...}) in `text`, braces balanced; None if there is none."""
    if not text:
        return None
    starts = [m.start() for m in re.finditer(r"\\(?:boxed|fbox)\s*\{", text)]
    for start in reversed(starts):
        i = text.index("{", start)
        depth = 0
        for j in range(i, len(text)):
            c = text[j]
            if c == "{" and text[j - 1] != "\\":
                depth += 1
            elif c == "}" and text[j - 1] != "\\":
                depth -= 1
                if depth == 0:
                    return text[i + 1 : j].strip()
        # unbalanced: try an earlier \boxed
    m = re.search(r"\\boxed ([^\s$]+)", text)  # "\boxed 5" form
    return m.group(1) if m else None


_NUM = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


def parse_number(s: str | None) -> Fraction | None:
    """A single number in `s` ("1,000", "$18.00", "18 dollars", "\\$5", "50\\%", "\\frac{3}{4}", "-2.5"),
    as an exact Fraction; None if there is not exactly one number."""
    if s is None:
        return None
    t = s.strip().strip("$").replace("\\!", "").replace("\\,", "").replace("{,}", ",")
    t = re.sub(r"\\text\{[^{}]*\}|\\mbox\{[^{}]*\}|\\%|%|\\\$|\\dollar", " ", t)
    t = re.sub(r"\\([dt]?frac)(\d)(\d)", r"\\\1{\2}{\3}", t)  # \frac12 shorthand
    m = re.fullmatch(r"\s*(-?)\\[dt]?frac\{(-?\d+)\}\{(\d+)\}\s*", t)
    if m:
        return (
            Fraction(int(m.group(2)), int(m.group(3))) * (-1 if m.group(1) else 1)
            if int(m.group(3))
            else None
        )
    m = re.fullmatch(r"\s*(-?\d+)\s*/\s*(\d+)\s*", t)
    if m:
        return Fraction(int(m.group(1)), int(m.group(2))) if int(m.group(2)) else None
    nums = _NUM.findall(t)
    if len(nums) != 1:
        return None
    n = nums[0].replace(",", "")
    try:
        return Fraction(n)
    except (ValueError, ZeroDivisionError):
        return None


def numbers_equal(pred: str | None, gold: str | None) -> bool:
    a, b = parse_number(pred), parse_number(gold)
    return a is not None and b is not None and a == b


def math_equal(pred: str | None, gold: str | None, timeout: float = 5.0) -> bool:
    """True if `pred` and `gold` are the same mathematical answer (LaTeX or plain). Exact string or
    number matches are decided here; everything else goes to math-verify in a helper process that is
    killed after `timeout` seconds (then the answer counts as wrong; marlflow.tasks.verifier). Safe in any
    thread."""
    if pred is None or gold is None:
        return False
    p, g = pred.strip(), gold.strip()
    if not p:
        return False
    if p == g:
        return True
    a, b = parse_number(p), parse_number(g)
    if a is not None and b is not None:
        return a == b
    return verify(p, g, timeout)


# --------------------------------------------------------------------------------------------------
# Tasks


def gsm8k_gold(answer: str) -> str:
    return answer.split("####")[-1].strip().replace(",", "")


class _MathTask:
    kind = "math"
    name = ""
    timeout = 5.0

    def extract(self, text: str) -> str | None:
        return last_boxed(text)

    def check(self, pred: str, gold: str) -> bool:
        return math_equal(pred, gold, timeout=self.timeout)

    def score(self, problems: Sequence[Problem], outputs: Sequence[str]) -> list[float]:
        if len(problems) != len(outputs):
            raise ValueError(f"{len(problems)} problems but {len(outputs)} outputs")
        preds = [self.extract(o) for o in outputs]
        # math-verify checks are independent; a few threads keep the helper processes busy.
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(max(1, min(4, len(preds)))) as ex:
            oks = list(
                ex.map(lambda pg: pg[0] is not None and self.check(pg[0], pg[1].answer), zip(preds, problems))
            )
        return [1.0 if ok else 0.0 for ok in oks]


@register("gsm8k")
class GSM8K(_MathTask):
    """GSM8K (openai/gsm8k, config main): train 7,473 / test 1,319; gold = the number after ####."""

    name = "gsm8k"
    hub_id, hub_config = "openai/gsm8k", "main"

    def extract(self, text: str) -> str | None:
        b = last_boxed(text)
        if b is None and text and "####" in text:
            b = (
                text.rsplit("####", 1)[1].strip().splitlines()[0]
                if text.rsplit("####", 1)[1].strip()
                else None
            )
        return b

    def check(self, pred: str, gold: str) -> bool:
        if numbers_equal(pred, gold):
            return True
        return parse_number(pred) is None and math_equal(pred, gold, timeout=self.timeout)

    def load(self, split: str, spec=None) -> list[Problem]:
        check_split(split)
        rows, _ = source_rows(spec, split, self.hub_id, self.hub_config, split)
        out = []
        for i in range(len(rows)):
            q, a = field(rows, i, "question"), str(field(rows, i, "answer", "answer"))
            out.append(Problem(f"gsm8k/{split}/{i}", "gsm8k", "math", q, gsm8k_gold(a), meta={"solution": a}))
        return nonempty(cap(out, spec, split), self.name, split)


@register("math")
class MATH(_MathTask):
    """Hendrycks MATH: train (PRM800K 12,000 locally) / test MATH-500. Gold = `answer`, else last boxed."""

    name = "math"
    # The hub has no PRM800K train split: the default train source is MATH's original 7,500 train problems.
    # The local data/math/train.jsonl (12,000 = PRM800K train) is what matrix.yaml should point to.
    hub_ids = {
        "train": ("DigitalLearningGmbH/MATH-lighteval", "default"),
        "test": ("HuggingFaceH4/MATH-500", None),
    }

    def load(self, split: str, spec=None) -> list[Problem]:
        check_split(split)
        hub_id, cfg = self.hub_ids[split]
        rows, _ = source_rows(spec, split, hub_id, cfg, "test" if split == "test" else "train")
        out = []
        for i, r in enumerate(rows):
            problem = field(rows, i, "problem")
            gold = field(rows, i, "answer", "answer", required=False)
            if gold in (None, ""):
                gold = last_boxed(field(rows, i, "solution", required=False, default=""))
            if gold is None:
                continue
            uid = field(rows, i, "unique_id", "answer", required=False) or str(i)
            out.append(
                Problem(
                    f"math/{uid}",
                    "math",
                    "math",
                    problem,
                    str(gold),
                    meta={k: r.get(k) for k in ("subject", "level")},
                )
            )
        return nonempty(cap(out, spec, split), self.name, split)


@register("dapo_math")
class DAPOMath(_MathTask):
    """open-r1/DAPO-Math-17k-Processed, config `en`, split 90/10 with seed 42 (12,704 / 1,412)."""

    name = "dapo_math"
    hub_id, hub_config = "open-r1/DAPO-Math-17k-Processed", "en"

    def load(self, split: str, spec=None) -> list[Problem]:
        check_split(split)
        rows, is_split = source_rows(spec, split, self.hub_id, self.hub_config, "train")
        # Checked before the split so that an error names the row of the file, not of a shuffled split.
        items = [
            (field(rows, i, "prompt"), str(field(rows, i, "solution", "answer"))) for i in range(len(rows))
        ]
        if not is_split:
            train, test = split_records(items, 0.1, seed=42)
            items = train if split == "train" else test
        out = [Problem(f"dapo_math/{split}/{i}", "dapo_math", "math", q, a) for i, (q, a) in enumerate(items)]
        return nonempty(cap(out, spec, split), self.name, split)

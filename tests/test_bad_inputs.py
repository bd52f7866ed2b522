"""Bad input: one test per row of the bad-input table in docs/reference.md ("Reliability").

Each bad input must give an error that names the problem and the fix (one line, no traceback, a non-zero
exit code), or a documented, counted handling, and nothing already written may be lost. Matrix-file rows
that tests/test_matrix.py already checks in-process are checked here only for what that file does not
cover: the same message through Snakemake and through `python -m marlflow matrix`.

Training rows use the real code paths: the toy model built by conftest's `make_cfg` fixture, the train
CLI (`marlflow.cli.train.main`, in-process or as a subprocess), and `build_trainer` for the trainer itself.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch
from safetensors.torch import load_file

from marlflow.cli import matrix as matrix_cli
from marlflow.cli import train as T
from marlflow.cli.train import build_trainer
from marlflow.core.config import TaskSpec
from marlflow.tasks import register
from marlflow.tasks.toy import ToyMath
from marlflow.training.trainer import NaNLossError

ROOT = Path(__file__).resolve().parents[1]
MATRIX = ROOT / "matrix.yaml"
SNAKEMAKE = Path(sys.executable).parent / "snakemake"


@register("bi_parity")
class Parity(ToyMath):
    """Reward = output length is odd: reward variance inside every group, so real, non-zero updates."""

    name = "bi_parity"

    def score(self, problems, outputs):
        return [float(len(o) % 2) for o in outputs]


@register("bi_constant")
class Constant(ToyMath):
    """Every output gets the same reward: every GRPO group has zero advantage."""

    name = "bi_constant"

    def score(self, problems, outputs):
        return [1.0] * len(outputs)


# ---------------------------------------------------------------- matrix.yaml


def _bad_matrix(tmp_path, old, new):
    text = MATRIX.read_text()
    assert old in text, old
    bad = tmp_path / "matrix.yaml"
    bad.write_text(text.replace(old, new, 1))
    return bad


MATRIX_CASES = {
    "unknown_workflow": ("eval_opt, voting, orch_workers]", "eval_opt, votng, orch_workers]", None,
                         ["presets.toy.axes.workflow[2]", "'votng'", "Did you mean 'voting'", "Allowed values"]),
    "misspelled_key": ("group_size: 8", "group_sise: 8", None,
                       ["presets.toy.grpo.group_sise is not a known key", "Did you mean 'group_size'"]),
    "wrong_type": ("learning_rate: 2.0e-3", "learning_rate: 2e-3", None,
                   ["presets.toy.grpo.learning_rate", "'2e-3'", "must be number", "write 2.0e-3"]),
    "empty_axis": ("seed: [0]", "seed: []", None, ["presets.toy.axes.seed is empty", "list at least one value"]),
    "unknown_preset": ("toy", "toy", "papr",
                       ["preset: 'papr' is not a defined preset", "Did you mean 'paper'", "Defined presets: toy"]),
    # preset toy: the default toy2 sets its own eval_every and steps, so only v1's toy expands the bad value
    "eval_every_gt_steps": ("eval_every: 10", "eval_every: 100", "toy",
                            ["presets.toy", "grpo.eval_every is 100 but grpo.steps is 40", "between 1 and steps"]),
}  # fmt: skip


@pytest.mark.slow
@pytest.mark.skipif(not SNAKEMAKE.exists(), reason="snakemake is not installed in this environment")
@pytest.mark.parametrize("case", list(MATRIX_CASES))
def test_matrix_error_same_from_snakemake_and_cli(tmp_path, capsys, case):
    """The row's message, one line, exit 2, no traceback, identical from the CLI and from Snakemake."""
    old, new, preset, expected = MATRIX_CASES[case]
    bad = _bad_matrix(tmp_path, old, new)
    assert matrix_cli.main([str(bad), *(["--preset", preset] if preset else [])]) == 2
    cli = capsys.readouterr().err.strip()
    assert len(cli.splitlines()) == 1 and cli.startswith(f"error: {bad}: ")
    for part in expected:
        assert part in cli, (part, cli)
    env = {**os.environ, "PATH": f"{SNAKEMAKE.parent}{os.pathsep}{os.environ['PATH']}"}
    cfg = [f"matrix={bad}", *([f"preset={preset}"] if preset else [])]
    out = subprocess.run([str(SNAKEMAKE), "-n", "--profile", "profiles/local", "--config", *cfg], cwd=ROOT,
                         capture_output=True, text=True, env=env, timeout=120)  # fmt: skip
    assert out.returncode == 2, out.stdout + out.stderr
    assert cli in out.stderr and "Traceback" not in out.stderr


def test_matrix_file_missing(tmp_path, capsys):
    assert matrix_cli.main([str(tmp_path / "nope.yaml")]) == 2
    err = capsys.readouterr().err
    assert f"nope.yaml: file not found: {tmp_path / 'nope.yaml'} does not exist" in err
    assert "looked up in the current folder" in err and "--config matrix=PATH/matrix.yaml" in err


def test_matrix_file_not_yaml(tmp_path, capsys):
    bad = _bad_matrix(tmp_path, "  toy:\n", "  toy: [\n")
    assert matrix_cli.main([str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert "not valid YAML at line" in err and len(err.splitlines()) == 1


# ---------------------------------------------------------------- the train CLI


def _write_cfg(tmp_path, cfg) -> Path:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(dataclasses.asdict(cfg)))
    return path


def _train_main(tmp_path, cfg, capsys) -> tuple[int, str]:
    """`python -m marlflow train` in-process: (exit code, stderr); an escaping exception fails the test."""
    code = T.main(["--config", str(_write_cfg(tmp_path, cfg)), "--out", str(tmp_path / "run")])
    return code, capsys.readouterr().err


def _train_cli(tmp_path, cfg) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "marlflow.cli.train", "--config", str(_write_cfg(tmp_path, cfg)),
           "--out", str(tmp_path / "run")]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=240)


def _error_line(stderr: str) -> str:
    """The CLI's one error line (progress bars from transformers may share stderr); no traceback."""
    assert "Traceback" not in stderr, stderr
    lines = [ln for ln in stderr.splitlines() if ln.startswith("marlflow train:")]
    assert len(lines) == 1, stderr
    return lines[0]


@pytest.mark.slow
def test_model_path_does_not_exist(make_cfg, tmp_path):
    cfg = dataclasses.replace(make_cfg("single", "sp"), model=str(tmp_path / "models" / "toy"))
    out = _train_cli(tmp_path, cfg)
    assert out.returncode == 1
    line = _error_line(out.stderr)
    assert f"model folder '{tmp_path / 'models' / 'toy'}' does not exist" in line
    m = tmp_path / "models" / "toy"
    assert f"`marlflow models prepare --scale toy --model {m} --out {m}`" in line and "matrix.yaml" in line
    assert not (tmp_path / "run" / "DONE").exists()


def test_model_folder_without_config_json(make_cfg, tmp_path, capsys):
    (tmp_path / "half-built").mkdir()
    (tmp_path / "half-built" / "tokenizer.json").write_text("{}")
    cfg = dataclasses.replace(make_cfg("single", "sp"), model=str(tmp_path / "half-built"))
    code, err = _train_main(tmp_path, cfg, capsys)
    assert code == 1
    line = _error_line(err)
    assert "exists but has no config.json" in line and "`marlflow models prepare --scale SCALE" in line


@pytest.mark.slow
def test_tokenizer_without_chat_template(make_cfg, toy_model_dir, tmp_path):
    model = tmp_path / "no-template"
    shutil.copytree(toy_model_dir, model)
    (model / "chat_template.jinja").unlink()
    tok_cfg = json.loads((model / "tokenizer_config.json").read_text())
    tok_cfg.pop("chat_template", None)
    (model / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    out = _train_cli(tmp_path, dataclasses.replace(make_cfg("single", "sp"), model=str(model)))
    assert out.returncode == 1
    line = _error_line(out.stderr)
    assert f"the tokenizer of '{model}' has no chat template" in line
    assert "set tokenizer.chat_template" in line


def test_hub_model_not_cached_offline(make_cfg, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cfg = dataclasses.replace(make_cfg("single", "sp"), model="marlflow-test/no-such-model")
    code, err = _train_main(tmp_path, cfg, capsys)
    assert code == 1
    line = _error_line(err)
    assert "could not load hub model 'marlflow-test/no-such-model'" in line
    assert "huggingface-cli download" in line


def test_cuda_run_without_gpu(make_cfg, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    code, err = _train_main(tmp_path, dataclasses.replace(make_cfg("single", "sp"), device="cuda"), capsys)
    assert code == 1
    line = _error_line(err)
    assert "asks for device 'cuda'" in line and "torch sees no CUDA GPU" in line and "profiles/slurm" in line


def test_unknown_task_name(make_cfg, tmp_path, capsys):
    code, err = _train_main(tmp_path, make_cfg("single", "sp", task="toy_mth"), capsys)
    assert code == 2
    line = _error_line(err)
    assert "task 'toy_mth' is not registered" in line and "toy_math" in line and "matrix.yaml" in line
    assert not (tmp_path / "run").exists()  # failed before any work


def test_run_config_not_json(tmp_path, capsys):
    bad = tmp_path / "config.json"
    bad.write_text('{"run_id": "x", ')
    assert T.main(["--config", str(bad), "--out", str(tmp_path / "run")]) == 2
    line = _error_line(capsys.readouterr().err)
    assert f"invalid run config {bad}" in line


# Run configs broken in each of the ways below, through the real CLI in a subprocess. They fail
# before the model loads, so the model path need not exist.
def _valid_cfg() -> dict:
    from marlflow.core.config import GRPOParams, RunConfig

    cfg = RunConfig(run_id="single-sp-toy-math-s0", workflow="single", sharing="sp", scale="toy",
                    task_axis="math", seed=0, task=TaskSpec(name="toy_math"), model="unused-model",
                    grpo=GRPOParams(steps=2, eval_every=1))  # fmt: skip
    return dataclasses.asdict(cfg)


def _edit(**kv):
    def f(d):
        for k, v in kv.items():
            *head, last = k.split(".")
            target = d
            for h in head:
                target = target[h]
            target[last] = v
        return d

    return f


CONFIG_CASES = {
    "directory": (None, ["is a directory"]),
    "empty_list": (lambda d: [], ["must be a JSON object, not list"]),
    "seed_list": (_edit(seed=[1]), ["seed is [1] of type list", "must be an integer"]),
    "seed_text": (_edit(seed="abc"), ["seed is 'abc' of type str", "must be an integer"]),
    "seed_too_big": (_edit(seed=2**31), ["seed is 2147483648", "<= 2147483647"]),
    "model_int": (_edit(model=5), ["model is 5 of type int", "must be a string"]),
    "threads_text": (_edit(threads="1"), ["threads is '1' of type str", "must be an integer"]),
    "threads_huge": (_edit(threads=10**20), ["threads is 100000000000000000000", "<= 1024"]),
    "steps_float": (_edit(**{"grpo.steps": 2.0}), ["grpo.steps is 2.0 of type float", "must be an integer"]),
    "lr_nan": (_edit(**{"grpo.learning_rate": float("nan")}), ["grpo.learning_rate is nan", "finite"]),
    "beta_negative": (_edit(**{"grpo.beta": -0.04}), ["grpo.beta is -0.04", ">= 0"]),
    "bogus_scheduler": (_edit(**{"grpo.lr_scheduler": "bogus"}), ["grpo.lr_scheduler is 'bogus'", "cosine"]),
    "task_not_mapping": (_edit(task="toy_math"), ["task is 'toy_math' of type str", "must be a mapping"]),
    "task_without_name": (lambda d: {**d, "task": {"eval_size": 4}}, ["task.name is missing"]),
    "unknown_grpo_key": (_edit(**{"grpo.stpes": 3}), ["grpo.stpes is not a known key", "allowed: steps"]),
    "not_utf8": (b'{"run_id": "\xff"}', ["not UTF-8"]),
    "bad_json_line": (b'{\n  "run_id": "x",\n  "seed": 0,,\n}', ["not valid JSON at line 3"]),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CONFIG_CASES))
def test_train_cli_bad_run_config(tmp_path, case):
    """Exit 2 before any work: one line naming the config file and the key, no traceback, <= 4 KB,
    and no run folder."""
    edit, expected = CONFIG_CASES[case]
    path = tmp_path / "config.json"
    if edit is None:
        path.mkdir()
    elif isinstance(edit, bytes):
        path.write_bytes(edit)
    else:
        path.write_text(json.dumps(edit(_valid_cfg())))
    cmd = [sys.executable, "-m", "marlflow.cli.train", "--config", str(path), "--out", str(tmp_path / "run")]
    out = subprocess.run(
        cmd, capture_output=True, text=True, timeout=120, env={**os.environ, "HF_HUB_OFFLINE": "1"}
    )
    assert out.returncode == 2, out.stderr[-2000:]
    line = _error_line(out.stderr)
    assert len(out.stderr.encode()) <= 4096
    assert line.startswith(f"marlflow train: invalid run config {path}: "), line
    for part in expected:
        assert part in line, (part, line)
    assert not (tmp_path / "run").exists()


def _jsonl(path: Path, rows) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def _gsm8k_rows(n):
    return [{"question": f"{k}+1?", "answer": f"#### {k + 1}"} for k in range(n)]


def _mbpp_row(task_id):
    return {"task_id": task_id, "text": "Return 1.", "code": "def f():\n    return 1\n",
            "test_list": ["assert f() == 1"], "test_setup_code": ""}  # fmt: skip


# name -> (task name, train rows (or bytes), substrings of the message besides the file name)
DATA_CASES = {
    "missing_field": ("gsm8k", [*_gsm8k_rows(2), {"question": "x?"}],
                      ["line 3: field 'answer' is missing", "it must be a string or a number", "question"]),
    "null_field": ("gsm8k", [{"question": None, "answer": "#### 1"}], ["line 1: field 'question' is null"]),
    "array_field": ("gsm8k", [*_gsm8k_rows(1), {"question": ["a", "b"], "answer": "#### 1"}],
                    ["line 2: field 'question' is ['a', 'b'] of type list", "must be a string"]),
    "row_is_array": ("gsm8k", [*_gsm8k_rows(1), [1, 2]], ["line 2: the row is a JSON list"]),
    "not_utf8": ("gsm8k", b'{"question": "1+1?", "answer": "#### 2"}\n{"question": "caf\xe9", "answer": "#### 1"}\n',
                 ["line 2: not UTF-8 (byte 0xe9)", "iconv"]),
    "bad_json_line": ("gsm8k", [*_gsm8k_rows(2), "", '{"question": "x", "answer": '],
                      ["line 4: not valid JSON", "one JSON object per line"]),
    "mbpp_task_id_text": ("mbpp", [_mbpp_row(601), _mbpp_row("six hundred")],
                          ["line 2: field 'task_id' is 'six hundred'", "must be an integer"]),
    "mbpp_test_list_text": ("mbpp", [{**_mbpp_row(601), "test_list": "assert f() == 1"}],
                            ["line 1: field 'test_list'", "must be a list of strings"]),
    "deepcoder_tests_not_json": ("deepcoder", [{"problem": "p", "solutions": [], "tests": "[{'input': 1"}],
                                 ["line 1: field 'tests' is not valid JSON"]),
}  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("case", list(DATA_CASES))
def test_train_cli_bad_dataset_rows(tmp_path, case):
    """Exit 1 before the model loads, one line naming the file, the line and the field; no run folder."""
    task, rows, expected = DATA_CASES[case]
    train = tmp_path / "train.jsonl"
    if isinstance(rows, bytes):
        train.write_bytes(rows)
    else:
        _jsonl(train, rows)
    good = {"gsm8k": _gsm8k_rows(4), "mbpp": [_mbpp_row(11)], "deepcoder": []}[task]
    test = _jsonl(tmp_path / "test.jsonl", good)
    cfg = _valid_cfg()
    cfg["task"] = dataclasses.asdict(TaskSpec(name=task, train_file=str(train), test_file=test, eval_size=4))
    cfg["task_axis"] = "code" if task != "gsm8k" else "math"
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    cmd = [sys.executable, "-m", "marlflow.cli.train", "--config", str(path), "--out", str(tmp_path / "run")]
    out = subprocess.run(
        cmd, capture_output=True, text=True, timeout=120, env={**os.environ, "HF_HUB_OFFLINE": "1"}
    )
    assert out.returncode == 1, out.stderr[-2000:]
    line = _error_line(out.stderr)
    assert len(out.stderr.encode()) <= 4096
    assert str(train) in line and f"dataset of task {task!r}" in line, line
    for part in expected:
        assert part in line, (part, line)
    assert not (tmp_path / "run").exists()


def test_failed_run_leaves_no_empty_folder(make_cfg, tmp_path, capsys):
    """A run that fails after the run folder was made (here: the model) removes the folder it created,
    but never a folder that existed before."""
    cfg = dataclasses.replace(make_cfg("single", "sp"), model=str(tmp_path / "no-model"))
    code, _ = _train_main(tmp_path, cfg, capsys)
    assert code == 1 and not (tmp_path / "run").exists()
    (tmp_path / "run").mkdir()
    code, _ = _train_main(tmp_path, cfg, capsys)
    assert code == 1 and (tmp_path / "run").is_dir()


def _gsm8k_file(path: Path, n: int) -> str:
    path.write_text(
        "".join(json.dumps({"question": f"{k}+1?", "answer": f"#### {k + 1}"}) + "\n" for k in range(n))
    )
    return str(path)


def test_missing_local_dataset_file(make_cfg, tmp_path, capsys):
    task = TaskSpec(name="gsm8k", train_file=_gsm8k_file(tmp_path / "train.jsonl", 8),
                    test_file="/nonexistent.jsonl", eval_size=4)  # fmt: skip
    code, err = _train_main(tmp_path, dataclasses.replace(make_cfg("single", "sp"), task=task), capsys)
    assert code == 1
    line = _error_line(err)
    assert "dataset file '/nonexistent.jsonl' does not exist" in line
    assert "fix `task.test_file` for this task in matrix.yaml" in line
    assert not (tmp_path / "run" / "DONE").exists()


def test_empty_dataset(make_cfg, tmp_path, capsys):
    (tmp_path / "empty.jsonl").write_text("")
    task = TaskSpec(name="gsm8k", train_file=str(tmp_path / "empty.jsonl"),
                    test_file=_gsm8k_file(tmp_path / "test.jsonl", 4), eval_size=4)  # fmt: skip
    code, err = _train_main(tmp_path, dataclasses.replace(make_cfg("single", "sp"), task=task), capsys)
    assert code == 1
    line = _error_line(err)
    assert "task 'gsm8k': the train split is empty" in line and "`task.train_file`" in line


# ---------------------------------------------------------------- during training


def _ckpt_tensors(run: Path, step: int) -> dict:
    ckpt = run / "checkpoints" / f"step-{step}" / "adapters"
    return {
        str(f.relative_to(ckpt)) + k: v
        for f in sorted(ckpt.rglob("*.safetensors"))
        for k, v in load_file(f).items()
    }


def _same(a: dict, b: dict) -> bool:
    assert a.keys() == b.keys() and a
    return all(torch.equal(a[k], b[k]) for k in a)


def test_nan_loss_skipped_counted_logged_then_stops(make_cfg, tmp_path, monkeypatch, caplog):
    """A NaN step is skipped (adapters unchanged), counted (nan_skipped = 1) and logged; max_nan_steps NaN
    steps in a row stop the run with NaNLossError, and the last complete checkpoint still loads."""
    cfg = make_cfg("single", "sp", task="bi_parity", steps=5, eval_every=5, save_every=1, max_nan_steps=2)
    trainer = build_trainer(cfg, tmp_path)
    orig, nan_steps = trainer.trl.loss, {2, 4, 5}

    def loss(model, inputs, beta):
        out = orig(model, inputs, beta)
        return dataclasses.replace(out, loss=out.loss * float("nan")) if trainer.step in nan_steps else out

    monkeypatch.setattr(trainer.trl, "loss", loss)
    with (
        caplog.at_level(logging.WARNING, logger="marlflow.training.trainer"),
        pytest.raises(NaNLossError, match="2 consecutive steps had a non-finite loss") as exc,
    ):
        trainer.fit()
    assert "last good checkpoint is kept" in str(exc.value) and "grpo.learning_rate" in str(exc.value)
    logged = [r.getMessage() for r in caplog.records if "non-finite loss" in r.getMessage()]
    assert [m.split(":")[0] for m in logged] == ["step 2", "step 4", "step 5"]
    ckpts = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert ckpts == ["step-1", "step-2", "step-3", "step-4"]  # step 5 never completed; nothing torn left
    # skipped steps leave the adapters as they were; good steps move them
    t = {s: _ckpt_tensors(tmp_path, s) for s in (1, 2, 3, 4)}
    assert _same(t[1], t[2]) and not _same(t[2], t[3]) and _same(t[3], t[4])
    m = pd.read_parquet(tmp_path / "checkpoints" / "step-4" / "metrics.parquet")
    skipped = m[(m.metric == "nan_skipped") & (m.role == "all")].set_index("step").value
    assert skipped.to_dict() == {1: 0.0, 2: 1.0, 3: 0.0, 4: 1.0}
    # the last complete checkpoint loads, and a rerun resumes from it
    again = build_trainer(cfg, tmp_path)
    assert again.restore() and (again.step, again.nan_streak) == (4, 1)


@pytest.mark.parametrize("sharing", ["sp", "ip"])
def test_nan_loss_stops_every_later_role(make_cfg, tmp_path, monkeypatch, sharing):
    """A non-finite loss in the first role discards the step at once: no later role (same policy under SP,
    another policy under IP) runs a backward, no adapter moves, and nan_skipped = 1."""
    cfg = make_cfg("voting", sharing, task="bi_parity", steps=1)
    trainer = build_trainer(cfg, tmp_path)
    orig, seen = trainer.trl.loss, []

    def loss(model, inputs, beta):
        out = orig(model, inputs, beta)
        seen.append(len(seen))
        return dataclasses.replace(out, loss=out.loss * float("nan")) if len(seen) == 1 else out

    monkeypatch.setattr(trainer.trl, "loss", loss)
    before = {p: [t.detach().clone() for t in st.params] for p, st in trainer.policies.items()}
    trainer.train_step(1)
    assert seen == [0]  # the generator's first piece; the aggregator never ran
    m = pd.DataFrame(trainer.metric_rows)
    m = m[m.split == "train"].set_index(["role", "metric"]).value
    assert m[("all", "nan_skipped")] == 1.0
    assert ("aggregator", "grad_norm") not in m.index
    for p, st in trainer.policies.items():
        assert all(torch.equal(a, b.detach()) for a, b in zip(before[p], st.params))


def test_every_group_zero_advantage(make_cfg, tmp_path):
    """Constant reward: the step runs without error, zero_adv_group_frac = 1, the gradient is exactly 0,
    so the only parameter change is AdamW's weight decay (none with grpo.weight_decay: 0)."""
    cfg = make_cfg("voting", "ip", task="bi_constant", steps=1)
    trainer = build_trainer(cfg, tmp_path)
    before = {p: [t.detach().clone() for t in st.params] for p, st in trainer.policies.items()}
    trainer.train_step(1)
    m = pd.DataFrame(trainer.metric_rows).set_index(["role", "metric"]).value
    for role in cfg.role_types:
        assert m[(role, "zero_adv_group_frac")] == 1.0
        assert m[(role, "advantage_mean")] == 0.0 and m[(role, "grad_norm")] == 0.0
    assert m[("all", "nan_skipped")] == 0.0 and m[("all", "grad_norm")] == 0.0
    decay = 1 - cfg.grpo.learning_rate * cfg.grpo.weight_decay
    for p, st in trainer.policies.items():
        for old, new in zip(before[p], st.params):
            torch.testing.assert_close(new.detach(), old * decay, rtol=0, atol=1e-7)

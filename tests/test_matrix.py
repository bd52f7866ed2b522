"""matrix.yaml expansion and its error messages (fast, no Snakemake)."""

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from marlflow.core.config import RunConfig
from marlflow.pipeline.matrix import MatrixError, check_run_ids, run_id, run_sheet

ROOT = Path(__file__).resolve().parents[1]
MATRIX = ROOT / "matrix.yaml"
DOC = yaml.safe_load(MATRIX.read_text())


def edited(fn):
    d = copy.deepcopy(DOC)
    fn(d)
    return d


@pytest.mark.parametrize(
    ("preset", "n"), [("toy", 14), ("paper", 42), ("smol", 14), ("smol_small", 2), ("smoke", 3)]
)
def test_expansion_counts(preset, n):
    sheet = run_sheet(MATRIX, preset)
    assert len(sheet) == n
    assert sheet.index.is_unique
    assert set(sheet["preset"]) == {preset}


def test_default_preset_is_toy2():
    """The default preset (`make run`, plain `snakemake`) is toy world v2's matrix: 14 runs at scale toy2."""
    assert DOC["default_preset"] == "toy2"
    sheet = run_sheet(MATRIX)
    assert len(sheet) == 14 and set(sheet["preset"]) == {"toy2"} and set(sheet["scale"]) == {"toy2"}
    assert "voting-sp-toy2-math-s0" in sheet.index and "single-sp-toy2-code-s0" in sheet.index


def test_single_only_sp():
    for preset in ("toy", "paper", "smol"):
        sheet = run_sheet(MATRIX, preset)
        assert set(sheet.loc[sheet.workflow == "single", "sharing"]) == {"sp"}
        assert set(sheet.loc[sheet.workflow != "single", "sharing"]) == {"sp", "ip"}


def test_run_ids_and_config():
    sheet = run_sheet(MATRIX, "toy")
    assert "voting-ip-toy-math-s0" in sheet.index
    assert "single-sp-toy-code-s0" in sheet.index
    assert run_id("eval_opt", "sp", "0.6b", "code", 1) == "eval_opt-sp-0.6b-code-s1"
    assert run_id("voting", "ip", "1.7b", "math", 0, "kl_anchor") == "voting-ip-1.7b-math-s0-kl_anchor"
    cfg = RunConfig.from_dict(json.loads(sheet.loc["voting-ip-toy-math-s0", "config"]))
    assert (cfg.workflow, cfg.sharing, cfg.task.name, cfg.model) == (
        "voting",
        "ip",
        "toy_math",
        "results/models/toy",
    )
    assert cfg.grpo.steps == 40 and cfg.grpo.group_size == 8 and cfg.grpo.learning_rate == 2e-3


def test_paper_lengths_and_models():
    sheet = run_sheet(MATRIX, "paper")
    assert set(sheet.model) == {"Qwen/Qwen3-0.6B", "Qwen/Qwen3-1.7B", "Qwen/Qwen3-4B"}

    def lengths(rid):
        g = json.loads(sheet.loc[rid, "config"])["grpo"]
        return g["max_prompt_length"], g["max_completion_length"]

    assert lengths("eval_opt-ip-4b-math-s0") == (30720, 5120)
    assert lengths("voting-sp-0.6b-math-s0") == (20480, 5120)
    assert lengths("orch_workers-ip-1.7b-math-s0") == (20480, 5120)
    assert lengths("single-sp-4b-math-s0") == (15360, 5120)
    assert lengths("eval_opt-sp-0.6b-code-s0") == (10240, 2048)
    assert lengths("single-sp-0.6b-code-s0") == (4096, 2048)
    cfg = json.loads(sheet.loc["voting-ip-4b-code-s0", "config"])
    assert (cfg["backend"], cfg["device"], cfg["grpo"]["lora_r"], cfg["task"]["source"]) == (
        "vllm",
        "cuda",
        64,
        "agentica-org/DeepCoder-Preview-Dataset",
    )


def test_overrides_restrict_axes():
    sheet = run_sheet(MATRIX, "smol", {"workflows": ["voting"], "tasks": "math", "seeds": ["0", "1"]})
    assert sorted(sheet.index) == sorted(f"voting-{s}-smol-math-s{k}" for s in ("sp", "ip") for k in (0, 1))


# Edits of v1's `toy` expand it by name: the default preset, toy2, overrides some of these keys (steps, eval_every,
# scale), so it would not hold every edited value.
@pytest.mark.parametrize(
    ("edit", "preset", "overrides", "expected"),
    [
        (lambda d: d["presets"]["toy"]["axes"].update(workflow=["single", "votng"]), "toy", None,
         ["presets.toy.axes.workflow[1]", "'votng'", "orch_workers", "Did you mean 'voting'"]),
        (lambda d: d["presets"]["toy"]["grpo"].update(stpes=3), "toy", None,
         ["presets.toy.grpo.stpes", "Did you mean 'steps'"]),
        (lambda d: d["presets"]["toy"]["grpo"].update(steps="forty"), "toy", None,
         ["presets.toy.grpo.steps", "'forty'", "integer"]),
        (lambda d: d["presets"]["toy"]["axes"].update(task=[]), "toy", None, ["presets.toy.axes.task", "empty"]),
        (lambda d: None, "papr", None, ["preset", "'papr'", "Did you mean 'paper'", "toy"]),
        (lambda d: d["presets"]["toy"]["grpo"].update(eval_every=100), "toy", None,
         ["presets.toy", "single-sp-toy-math-s0", "eval_every", "steps"]),
        (lambda d: d["presets"]["toy"]["grpo"].update(group_size=1), "toy", None,
         ["presets.toy", "group_size", "at least 2"]),
        (lambda d: d["presets"]["toy"]["axes"].update(scale=["toy", "4b"]), "toy", None,
         ["presets.toy.models", "'4b'"]),
        (lambda d: None, None, {"workflws": ["voting"]}, ["workflws", "Did you mean 'workflows'"]),
    ],
)  # fmt: skip
def test_errors_name_the_key(edit, preset, overrides, expected):
    with pytest.raises(MatrixError) as exc:
        run_sheet(edited(edit), preset, overrides)
    msg = str(exc.value)
    assert "\n" not in msg  # one paragraph
    for part in expected:
        assert part in msg, (part, msg)


def test_cli_ok_and_json():
    out = subprocess.run(
        [sys.executable, "-m", "marlflow", "matrix", str(MATRIX), "--preset", "paper"],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr
    assert "42 runs (preset paper)" in out.stdout
    out = subprocess.run(
        [sys.executable, "-m", "marlflow", "matrix", str(MATRIX), "--json"],
        capture_output=True,
        text=True,
    )
    assert len(json.loads(out.stdout)) == 14


def test_cli_invalid_exits_2_without_traceback(tmp_path):
    bad = tmp_path / "matrix.yaml"
    bad.write_text(
        MATRIX.read_text().replace("eval_opt, voting, orch_workers]", "eval_opt, votng, orch_workers]", 1)
    )
    out = subprocess.run(
        [sys.executable, "-m", "marlflow", "matrix", str(bad)], capture_output=True, text=True
    )
    assert out.returncode == 2
    assert "Traceback" not in out.stderr
    assert "presets.toy.axes.workflow[2]" in out.stderr and "'votng'" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


def test_paper_micro_ci_slice_covers_every_workflow_sharing_and_task():
    """CI's SLURM slice of paper_micro (`exclude:` cuts the grid) still has each factor level at least once."""
    full = run_sheet(ROOT / "matrix.yaml", "paper_micro")
    ci = run_sheet(ROOT / "matrix.yaml", "paper_micro_ci")
    assert len(full) == 14 and len(ci) == 4
    assert {rid.removesuffix("_ci") for rid in ci.index} <= set(full.index)  # the same cells, tagged
    assert set(ci.workflow) == {"single", "eval_opt", "voting", "orch_workers"}
    assert set(ci.sharing) == {"sp", "ip"} and set(ci.task) == {"math", "code"}
    cfg = json.loads(ci.iloc[0].config)
    assert (cfg["backend"], cfg["device"], cfg["grpo"]["steps"]) == ("vllm", "cpu", 1)
    assert {json.loads(c)["task"]["name"] for c in ci.config} == {"dapo_math", "deepcoder"}


def test_exclude_drops_matching_cells_only():
    doc = yaml.safe_load((ROOT / "matrix.yaml").read_text())
    doc["presets"]["toy"]["exclude"] = [{"workflow": "voting", "sharing": "ip"}]
    sheet = run_sheet(doc, "toy")
    assert len(sheet) == 12 and not ((sheet.workflow == "voting") & (sheet.sharing == "ip")).any()


def test_work_estimate_puts_the_longest_runs_first():
    """The train rule's priority: completion tokens generated at most, training rollouts plus evaluations."""
    from marlflow.pipeline.matrix import work_estimate

    sheet = run_sheet(ROOT / "matrix.yaml", "toy")
    w = {r: work_estimate(c) for r, c in sheet["config"].items()}
    # single math: (40 steps x 8 problems x 8 rollouts + 5 evals x (200 test + 64 validation problems)) x 1 call
    # x 24 tokens
    assert w["single-sp-toy-math-s0"] == (40 * 8 * 8 + 5 * (200 + 64)) * 1 * 24
    # Eval-Opt with 2 rounds: up to 4 calls; Voting 3 + 1; Orch-Workers 3 + 2; code completions are 40 tokens
    assert w["voting-sp-toy-math-s0"] == 4 * w["single-sp-toy-math-s0"] == w["eval_opt-sp-toy-math-s0"]
    assert w["orch_workers-ip-toy-math-s0"] == 5 * w["single-sp-toy-math-s0"]
    assert w["orch_workers-ip-toy-code-s0"] == max(w.values())


def test_a_run_id_means_one_run_across_presets():
    """A run id names its folder, so two presets may share one only for the same run (toy_seeds' seed 0 is
    toy's run); presets that train a cell differently carry a `tag:` (smoke, toy_long and its
    toy_interventions, paper_micro and its CI slice)."""
    check_run_ids(MATRIX)  # the shipped presets
    toy, seeds = run_sheet(MATRIX, "toy"), run_sheet(MATRIX, "toy_seeds")
    assert set(toy.index) < set(seeds.index)
    assert all(rid.endswith("-smoke") for rid in run_sheet(MATRIX, "smoke").index)
    long_ids = set(run_sheet(MATRIX, "toy_long").index)
    assert long_ids == {
        run_id(w, "ip", "toy", "math", s, tag="long") for w in ("voting", "orch_workers") for s in range(3)
    }
    assert long_ids < set(run_sheet(MATRIX, "toy_interventions").index)  # the `none` runs are shared
    assert "voting-ip-toy-math-s0-long-cg" in run_sheet(MATRIX, "toy_interventions").index
    assert all(rid.endswith("-micro_ci") for rid in run_sheet(MATRIX, "paper_micro_ci").index)


def test_two_presets_that_train_one_run_id_differently_are_rejected(tmp_path):
    def longer(d, tag=None):
        d["presets"]["toy_more"] = {"extends": "toy", "grpo": {"steps": 80}, **({"tag": tag} if tag else {})}

    with pytest.raises(MatrixError) as err:
        check_run_ids(edited(longer))
    msg = str(err.value)
    assert "presets.toy and presets.toy_more" in msg and "'single-sp-toy-math-s0'" in msg
    assert "grpo.steps: 40 -> 80" in msg and "`tag:`" in msg
    fixed = edited(lambda d: longer(d, tag="more"))
    check_run_ids(fixed)
    assert "single-sp-toy-math-s0-more" in run_sheet(fixed, "toy_more").index
    with pytest.raises(MatrixError, match=r"presets\.toy_more\.tag"):
        run_sheet(edited(lambda d: longer(d, tag="More!")), "toy_more")
    # The CLI (and the Snakefile, which calls the same check) refuses the file: exit 2, one line.
    path = tmp_path / "matrix.yaml"
    path.write_text(yaml.safe_dump(edited(longer)))
    out = subprocess.run(
        [sys.executable, "-m", "marlflow", "matrix", str(path)], capture_output=True, text=True
    )
    assert out.returncode == 2 and "Traceback" not in out.stderr and "toy_more" in out.stderr


def test_build_axis_gives_its_own_model_and_run_ids():
    # toy_seeds crosses 3 seeds with 2 toy builds: build 0 keeps toy's run ids and shipped model, build 1
    # trains from results/models/toy-b1 under ids ending -b1, and both sets are one cell's replicates.
    sheet = run_sheet(MATRIX, "toy_seeds")
    assert len(sheet) == 84 and set(sheet["build"]) == {0, 1}
    b0, b1 = sheet.loc["voting-ip-toy-math-s2"], sheet.loc["voting-ip-toy-math-s2-b1"]
    assert (b0["build"], b0["model"]) == (0, "results/models/toy")
    assert (b1["build"], b1["model"]) == (1, "results/models/toy-b1")
    cfg0, cfg1 = (json.loads(r["config"]) for r in (b0, b1))
    assert "build" not in cfg0  # config.json of build-0 runs is what it was before the axis existed
    assert cfg1["build"] == 1 and RunConfig.from_dict(cfg1).factors["build"] == 1
    assert run_id("voting", "ip", "toy", "math", 2, "cg", "long", 3) == "voting-ip-toy-math-s2-b3-long-cg"
    assert set(run_sheet(MATRIX, "toy_seeds", {"builds": ["1"]})["build"]) == {1}
    assert set(run_sheet(MATRIX, "toy")["build"]) == {0}


@pytest.mark.parametrize(
    ("edit", "overrides", "expected"),
    [
        (lambda d: d["presets"]["smol"]["axes"].update(build=[0, 1]), None,
         ["presets.smol.axes.build", "scale smol", "toy model"]),
        (lambda d: None, {"builds": ["one"]}, ["override builds", "integers"]),
        (lambda d: d["presets"]["smol"]["axes"].update(build=[-1]), None, ["presets.smol.axes.build"]),
    ],
)  # fmt: skip
def test_build_axis_errors_name_the_key(edit, overrides, expected):
    with pytest.raises(MatrixError) as exc:
        run_sheet(edited(edit), "smol", overrides)
    for part in expected:
        assert part in str(exc.value), (part, str(exc.value))


def test_metrics_written_before_the_build_axis_read_as_build_0(tmp_path):
    # results/evidence/toy and runs trained before the axis have no `build` column: they are the shipped model's
    import pandas as pd

    from marlflow.analysis.io import load_runs
    from marlflow.store.schema import FACTOR_COLUMNS

    old = dict(run_id="voting-ip-toy-math-s0", workflow="voting", sharing="ip", scale="toy", task="math", seed=0,
               intervention="none", step=0, split="eval", role="all", metric="accuracy", value=0.5)  # fmt: skip
    new = {**old, "run_id": "voting-ip-toy-math-s0-b1", "build": 1}
    paths = []
    for rec in (old, new):
        (tmp_path / rec["run_id"]).mkdir()
        paths.append(tmp_path / rec["run_id"] / "metrics.parquet")
        pd.DataFrame([rec]).to_parquet(paths[-1])
    metrics, _ = load_runs(paths)  # same cell and seed, two builds: two replicates, not a clash
    assert "build" in FACTOR_COLUMNS
    assert dict(zip(metrics["run_id"], metrics["build"])) == {old["run_id"]: 0, new["run_id"]: 1}

"""Tests for marlflow.analysis and the aggregate CLI on synthetic runs with known answers."""

from __future__ import annotations

import json
import math

import pandas as pd
import pytest

from marlflow.analysis import (
    FAILURE_COLUMNS,
    GRAD_COLUMNS,
    SUMMARY_COLUMNS,
    aggregate,
    eval_curves,
    failure_signatures,
    grad_dynamics,
    load_runs,
    markdown_table,
    peak_terminal_latex,
    peak_terminal_table,
    solution_marker,
    summarize_runs,
    threshold,
)
from marlflow.analysis.io import SAMPLE_COLUMNS
from marlflow.analysis.plots import plot_curves, plot_grad_norm, plot_role_share, png_bytes
from marlflow.cli import aggregate as aggregate_cli
from marlflow.store.atomic import atomic_write_parquet
from marlflow.store.schema import METRIC_COLUMNS, rows, validate_metrics, with_build, write_metrics


def factors(run_id: str) -> dict:
    workflow, sharing, scale, task, seed = run_id.split("-")
    return dict(run_id=run_id, workflow=workflow, sharing=sharing, scale=scale, task=task,
                seed=int(seed[1:]), build=0, intervention="none")  # fmt: skip


def eval_rows(run_id: str, steps, acc, n_eval=100, se=None, halves=None) -> list[dict]:
    out = []
    for i, (s, a) in enumerate(zip(steps, acc)):
        vals = {"accuracy": a, "n_eval": n_eval, **(halves[i] if halves else {})}
        if se is not None:
            vals["accuracy_se"] = se
        out += rows(factors(run_id), s, "eval", "all", vals)
        out += rows(factors(run_id), s, "train", "all", {"reward_mean": a, "loss": 0.1 * i})
    return out


def val_rows(run_id: str, steps, acc, n_eval=64) -> list[dict]:
    """Validation accuracy per step (metrics rows split "val", role "all"), as the trainer logs them."""
    return [
        r
        for s, a in zip(steps, acc)
        for r in rows(factors(run_id), s, "val", "all", {"accuracy": a, "n_eval": n_eval})
    ]


def role_eval_rows(run_id: str, step: int, role: str, **vals) -> list[dict]:
    return rows(factors(run_id), step, "eval", role, vals)


def train_role_rows(run_id: str, role: str, norms, shares, start: int = 1) -> list[dict]:
    out = []
    for k, (n, s) in enumerate(zip(norms, shares)):
        out += rows(
            factors(run_id), start + k, "train", role, {"grad_norm": n, "grad_share": s, "samples": 8}
        )
    return out


CLIFF = "voting-ip-toy-math-s0"
MONO = "eval_opt-sp-toy-math-s0"
COLLAPSE = "orch_workers-sp-toy-code-s0"
CAPTURE = "voting-sp-toy-math-s0"
SAMPLE_CAPTURE = "eval_opt-ip-toy-code-s0"
SINGLE = "single-sp-toy-math-s0"
GRADS = "voting-ip-toy-code-s1"


def build_runs() -> dict[str, pd.DataFrame]:
    """run_id -> metrics DataFrame, covering each signature."""
    s5 = [0, 10, 20, 30, 40]
    runs = {
        CLIFF: eval_rows(CLIFF, s5, [0.40, 0.60, 0.70, 0.55, 0.50]),
        MONO: eval_rows(MONO, s5, [0.30, 0.35, 0.40, 0.45, 0.50], se=0.02),
        COLLAPSE: eval_rows(COLLAPSE, [0, 10, 20, 30], [0.50, 0.45, 0.30, 0.20], se=0.03),
        CAPTURE: eval_rows(CAPTURE, [0, 10, 20], [0.50, 0.52, 0.50])
        + role_eval_rows(CAPTURE, 0, "aggregator", completion_length=10.0, format_failure_rate=0.0)
        + role_eval_rows(CAPTURE, 20, "aggregator", completion_length=30.0, format_failure_rate=0.1)
        + role_eval_rows(CAPTURE, 0, "generator", completion_length=60.0)
        + role_eval_rows(CAPTURE, 20, "generator", completion_length=50.0),
        SAMPLE_CAPTURE: eval_rows(SAMPLE_CAPTURE, [0, 20], [0.30, 0.45], se=0.01)
        + role_eval_rows(SAMPLE_CAPTURE, 0, "evaluator", solution_marker_share=0.05, calls=300)
        + role_eval_rows(SAMPLE_CAPTURE, 20, "evaluator", solution_marker_share=0.40, calls=250),
        SINGLE: eval_rows(SINGLE, [0, 10, 20], [0.40, 0.50, 0.50]),
        GRADS: eval_rows(GRADS, [0, 2, 4, 6], [0.40, 0.50, 0.50, 0.40])
        + train_role_rows(GRADS, "generator", [1, 2, 3, 4, 5, 6], [0.5, 0.5, 0.6, 0.7, 0.8, 0.8])
        + train_role_rows(GRADS, "aggregator", [0.5] * 6, [0.5, 0.5, 0.4, 0.3, 0.2, 0.2]),
    }
    return {k: pd.DataFrame(v) for k, v in runs.items()}


def build_samples() -> pd.DataFrame:
    outs = [(0, "The solution is incorrect."), (0, "Correct."), (20, "```python\nprint(1)\n```"),
            (20, "so \\boxed{3}"), (20, "Correct.")]  # fmt: skip
    recs = []
    for ep, (step, text) in enumerate(outs):
        recs.append({**factors(SAMPLE_CAPTURE), "step": step, "episode": ep, "uid": f"p{ep}", "slot": "evaluator0",
                     "role": "evaluator", "prompt": "judge", "output": text, "reward": 0.0,
                     "format_failure": False})  # fmt: skip
    return pd.DataFrame(recs, columns=SAMPLE_COLUMNS)


@pytest.fixture
def metrics() -> pd.DataFrame:
    from marlflow.analysis.io import check_metrics
    from marlflow.store.schema import validate_metrics

    return check_metrics(validate_metrics(pd.concat(build_runs().values(), ignore_index=True)))


def write_runs(root, runs=None, samples=True) -> list[str]:
    paths = []
    for rid, df in sorted((runs or build_runs()).items()):
        p = root / "runs" / rid / "metrics.parquet"
        write_metrics(df, p)
        paths.append(str(p))
    if samples:
        atomic_write_parquet(build_samples(), root / "runs" / SAMPLE_CAPTURE / "samples.parquet")
    return paths


def by_run(df: pd.DataFrame) -> dict[str, dict]:
    return {r["run_id"]: r for r in df.to_dict("records")}


def test_threshold():
    assert threshold(0.01) == 0.05
    assert threshold(0.04) == pytest.approx(0.08)
    assert threshold(math.nan) == 0.05


def test_eval_curves_only_workflow_accuracy(metrics):
    c = eval_curves(metrics)
    assert set(c["run_id"]) == set(build_runs())
    assert len(c[c["run_id"] == CLIFF]) == 5
    assert c[c["run_id"] == MONO]["accuracy_se"].tolist() == [0.02] * 5


def test_summary_numbers(metrics):
    s = summarize_runs(metrics)
    assert list(s.columns) == SUMMARY_COLUMNS
    assert list(s["run_id"]) == sorted(build_runs())
    r = by_run(s)
    c = r[CLIFF]
    assert (c["base"], c["peak"], c["peak_step"], c["terminal"]) == (0.40, 0.70, 20, 0.50)
    assert c["terminal_mean3"] == pytest.approx((0.70 + 0.55 + 0.50) / 3)
    assert c["gain_peak"] == pytest.approx(0.30) and c["gain_terminal"] == pytest.approx(0.10)
    assert c["se"] == pytest.approx(math.sqrt(0.7 * 0.3 / 100))
    assert c["cliff"] and c["n_evals"] == 5
    m = r[MONO]
    assert (m["peak"], m["peak_step"], m["se"], m["cliff"]) == (0.50, 40, 0.02, False)
    # peak_step is the first step reaching the max (0.50 at 0, again nowhere higher)
    # ... and it never rose above its base, so it has no peak to fall from: a collapse, not a cliff
    assert r[COLLAPSE]["peak_step"] == 0 and not r[COLLAPSE]["cliff"] and r[COLLAPSE]["collapse"]
    assert r[SINGLE]["peak_step"] == 10 and not r[SINGLE]["cliff"]


def test_cliff_boundary_uses_tolerance():
    # n so large that the 5-point floor, not the SE, decides
    df = pd.DataFrame(eval_rows("voting-ip-toy-math-s9", [0, 10, 20], [0.40, 0.55, 0.50], n_eval=10**7))
    s = summarize_runs(df).iloc[0]
    assert 0.55 - 0.50 != 0.05 and bool(s["cliff"])  # 0.04999... still counts as 5 points
    df = pd.DataFrame(eval_rows("voting-ip-toy-math-s9", [0, 10, 20], [0.40, 0.55, 0.51], n_eval=10**7))
    assert not bool(summarize_runs(df).iloc[0]["cliff"])


def test_cliff_needs_more_than_noise():
    # docs/results.md's old cliffs ("One seed of the toy matrix"): 0.885 at step 20, 0.83 at 40, n = 200, 5 evals: within the noise now
    acc = [0.31, 0.80, 0.885, 0.86, 0.83]
    s = summarize_runs(pd.DataFrame(eval_rows(SINGLE, [0, 10, 20, 30, 40], acc, n_eval=200))).iloc[0]
    assert not s["cliff"] and s["drop"] == pytest.approx(0.885 - (0.86 + 0.83) / 2)
    # the same curve with a 20-point fall at the end is a cliff
    acc = [0.31, 0.80, 0.885, 0.75, 0.65]
    assert summarize_runs(pd.DataFrame(eval_rows(SINGLE, [0, 10, 20, 30, 40], acc, n_eval=200)))[
        "cliff"
    ].all()


def test_run_without_eval_or_base():
    df = pd.DataFrame(rows(factors("voting-ip-toy-math-s3"), 1, "train", "all", {"loss": 1.0}))
    df = pd.concat([df, pd.DataFrame(eval_rows("voting-ip-toy-math-s4", [10, 20], [0.5, 0.3]))])
    s = by_run(summarize_runs(df))
    assert s["voting-ip-toy-math-s3"]["n_evals"] == 0 and math.isnan(s["voting-ip-toy-math-s3"]["peak"])
    assert math.isnan(s["voting-ip-toy-math-s4"]["base"]) and s["voting-ip-toy-math-s4"]["cliff"]
    f = by_run(failure_signatures(df, summarize_runs(df)))
    assert f["voting-ip-toy-math-s3"]["evidence"] == "no eval accuracy"
    assert "no step-0 eval" in f["voting-ip-toy-math-s4"]["evidence"]
    assert not f["voting-ip-toy-math-s4"]["collapse"]


def test_failure_signatures(metrics):
    f = failure_signatures(metrics, summarize_runs(metrics))
    assert list(f.columns) == FAILURE_COLUMNS
    flags = {
        r["run_id"]: (r["cliff"], r["collapse"], r["stagnation"], r["capture"]) for r in by_run(f).values()
    }
    assert flags == {
        CLIFF: (True, False, False, False),
        MONO: (False, False, False, False),
        COLLAPSE: (False, True, True, False),  # never above its base: no peak, so no cliff
        CAPTURE: (False, False, True, True),
        SAMPLE_CAPTURE: (False, False, False, True),
        # at n = 100, +10 points over 2 evals and -10 points at the end are within the noise
        SINGLE: (False, False, True, False),
        GRADS: (False, False, True, False),
    }
    ev = by_run(f)
    assert ev[CLIFF]["evidence"] == (
        "cliff: drop 0.175 from an improved eval to the mean of the (<= 3) evals after it >= max(0.05, 2.22 x SE 0.061) "
        "(max 0.700 at step 20, terminal_mean3 0.583)"
    )
    assert ev[COLLAPSE]["evidence"].split("; ")[0] == "collapse: terminal_mean3 0.317 below base 0.500"
    assert "aggregator completion_length 10.0 -> 30.0" in ev[CAPTURE]["evidence"]
    assert (
        "evaluator solution_marker_share 0.05 -> 0.40 (steps 0 -> 20, 300 / 250 calls"
        in ev[SAMPLE_CAPTURE]["evidence"]
    )
    assert ev[MONO]["evidence"] == ""


def test_marker_never_matches_the_roles_own_format():
    """Eval-Opt's verdict \\boxed{Correct} and Voting's pick \\boxed{2} are not solutions (the old rule counted
    every \\boxed{ as one); a boxed answer or a code fence in a supervisory role's output is."""
    assert not solution_marker("eval_opt", "The steps check out. \\boxed{Correct}")
    assert not solution_marker("eval_opt", "\\boxed{ incorrect } the sign is wrong")
    assert solution_marker("eval_opt", "\\boxed{Incorrect}. It should be \\boxed{12}")
    assert not solution_marker("voting", "Solution 2 is right: \\boxed{2}")
    assert solution_marker("voting", "\\boxed{x = 3}") and solution_marker("voting", "```python\nf()\n```")
    assert solution_marker("orch_workers", "STRATEGY 1: add \\boxed{7}")
    assert not solution_marker("orch_workers", "STRATEGY 1: expand\nSTRATEGY 2: factor")
    assert not solution_marker("single", "\\boxed{3}")


def test_capture_share_rise_must_beat_its_noise():
    base = eval_rows(SAMPLE_CAPTURE, [0, 20], [0.30, 0.45])
    # the old false positive: 4 logged samples, one more with a marker (0.25) crossed the 0.2 threshold
    few = base + role_eval_rows(SAMPLE_CAPTURE, 0, "evaluator", solution_marker_share=0.0, calls=4)
    few += role_eval_rows(SAMPLE_CAPTURE, 20, "evaluator", solution_marker_share=0.25, calls=4)
    df = pd.DataFrame(few)
    assert not failure_signatures(df, summarize_runs(df)).iloc[0]["capture"]
    many = base + role_eval_rows(SAMPLE_CAPTURE, 0, "evaluator", solution_marker_share=0.0, calls=400)
    many += role_eval_rows(SAMPLE_CAPTURE, 20, "evaluator", solution_marker_share=0.25, calls=400)
    df = pd.DataFrame(many)
    assert failure_signatures(df, summarize_runs(df)).iloc[0]["capture"]


def test_capture_by_format_and_not_by_short_aggregator():
    base = eval_rows(CAPTURE, [0, 10], [0.5, 0.7])
    fmt = base + role_eval_rows(CAPTURE, 0, "aggregator", format_failure_rate=0.05)
    fmt += role_eval_rows(CAPTURE, 10, "aggregator", format_failure_rate=0.25)
    df = pd.DataFrame(fmt)
    r = failure_signatures(df, summarize_runs(df)).iloc[0]
    assert r["capture"] and "format_failure_rate 0.05 -> 0.25" in r["evidence"]
    # doubled but still far shorter than the generator: no capture
    ln = base + role_eval_rows(CAPTURE, 0, "aggregator", completion_length=5.0)
    ln += role_eval_rows(CAPTURE, 10, "aggregator", completion_length=10.0)
    ln += role_eval_rows(CAPTURE, 10, "generator", completion_length=100.0)
    df = pd.DataFrame(ln)
    assert not failure_signatures(df, summarize_runs(df)).iloc[0]["capture"]


def test_grad_dynamics(metrics):
    g = grad_dynamics(metrics)
    assert list(g.columns) == GRAD_COLUMNS
    assert list(zip(g["run_id"], g["role"])) == [(GRADS, "aggregator"), (GRADS, "generator")]
    gen, agg = g.iloc[1], g.iloc[0]
    assert gen["n_steps"] == 6 and gen["grad_norm_mean"] == 3.5 and gen["grad_norm_max"] == 6
    assert gen["grad_share_early"] == 0.5 and gen["grad_share_late"] == pytest.approx(0.8)
    assert gen["grad_share_shift"] == pytest.approx(0.3)
    assert gen["norm_ratio"] == agg["norm_ratio"] == pytest.approx(7.0)
    assert bool(gen["dominant"]) and not bool(agg["dominant"])
    assert gen["share_drop_corr"] == pytest.approx(1.0) and agg["share_drop_corr"] == pytest.approx(-1.0)


def test_peak_terminal_table(metrics):
    """The table's peak is the held-out one: voting-ip's validation accuracy peaks at step 30, where its test
    accuracy is 0.55 (the test maximum, 0.70 at step 20, is never shown); the other runs' validation follows
    their test curve. The caption names the estimate and the calibrated cliff test."""
    val = []
    for rid, c in eval_curves(metrics).groupby("run_id"):
        acc = [0.40, 0.45, 0.50, 0.60, 0.50] if rid == CLIFF else c["accuracy"].tolist()
        val += val_rows(rid, c["step"].tolist(), acc)
    s = summarize_runs(pd.concat([metrics, pd.DataFrame(val)], ignore_index=True))
    t = peak_terminal_table(s)
    assert t.attrs["peak"] == "peak_heldout"
    assert list(t.index) == [
        "single-sp",
        "eval_opt-sp",
        "eval_opt-ip",
        "voting-sp",
        "voting-ip",
        "orch_workers-sp",
    ]
    assert list(t.columns) == [("toy", "math"), ("toy", "code")]
    assert t.loc["voting-ip", ("toy", "math")] == "55.0 / 50.0 †"
    assert t.loc["eval_opt-sp", ("toy", "math")] == "50.0 / 50.0"
    assert t.loc["single-sp", ("toy", "code")] == "–"
    md = markdown_table(t)
    assert md.splitlines()[0] == "| workflow-sharing | toy math | toy code |"
    tex = peak_terminal_latex(t)
    assert "\\multicolumn{2}{c}{toy}" in tex and "55.0 / 50.0 $^\\dagger$" in tex and "eval\\_opt-sp" in tex
    assert "held-out peak (step selected on validation" in tex and "calibrated cliff test" in tex
    # without validation or half accuracies there is no headline peak: '–', never the test maximum
    bare = peak_terminal_table(summarize_runs(metrics))
    assert bare.loc["voting-ip", ("toy", "math")] == "– / 50.0 †"


def test_seeds_average_and_intervention_row():
    a = eval_rows("voting-ip-toy-math-s0", [0, 10], [0.4, 0.6]) + val_rows(
        "voting-ip-toy-math-s0", [0, 10], [0, 1]
    )
    b = eval_rows("voting-ip-toy-math-s1", [0, 10], [0.4, 0.8]) + val_rows(
        "voting-ip-toy-math-s1", [0, 10], [0, 1]
    )
    c = pd.DataFrame(
        eval_rows("voting-ip-toy-math-s2", [0, 10], [0.4, 0.5])
        + val_rows("voting-ip-toy-math-s2", [0, 10], [0, 1])
    ).assign(run_id="voting-ip-toy-math-s2-kl", intervention="kl")
    t = peak_terminal_table(summarize_runs(pd.concat([pd.DataFrame(a), pd.DataFrame(b), c])))
    assert t.to_dict("index") == {"voting-ip": {("toy", "math"): "70.0 / 70.0"},
                                  "voting-ip+kl": {("toy", "math"): "50.0 / 50.0"}}  # fmt: skip


def test_plots_panels(metrics):
    fig = plot_curves(metrics)
    assert len(fig.axes) == 4 * 2  # workflows x tasks present
    assert [ax.get_title() for ax in fig.axes[:2]] == ["single / math", "single / code"]
    assert len(plot_grad_norm(metrics).axes) == 1 and len(plot_role_share(metrics).axes) == 1
    assert png_bytes(fig).startswith(b"\x89PNG\r\n\x1a\n")
    empty = metrics[metrics["split"] == "train"]
    assert len(plot_curves(empty).axes) == 1 and len(plot_grad_norm(empty[empty["role"] == "all"]).axes) == 1


def test_load_runs_reads_samples_and_dedupes(tmp_path):
    paths = write_runs(tmp_path)
    m, s = load_runs(paths)
    assert list(m.columns) == METRIC_COLUMNS and list(s.columns) == SAMPLE_COLUMNS
    assert set(s["run_id"]) == {SAMPLE_CAPTURE}
    dup = pd.concat([build_runs()[MONO], build_runs()[MONO].assign(value=0.9)])
    write_metrics(dup, tmp_path / "dup" / "metrics.parquet")
    m, _ = load_runs([tmp_path / "dup" / "metrics.parquet"])
    assert (m[m["metric"] == "accuracy"]["value"] == 0.9).all() and len(m) == len(build_runs()[MONO])


def test_aggregate_cli_end_to_end(tmp_path, capsys):
    paths = write_runs(tmp_path)
    assert aggregate_cli.main(["--runs", *paths, "--out", str(tmp_path / "t1")]) == 0
    assert "aggregated 7 runs" in capsys.readouterr().out
    for name in aggregate.OUTPUTS:
        assert (tmp_path / "t1" / name).is_file(), name
    summary = pd.read_csv(tmp_path / "t1" / "summary.csv")
    assert list(summary.columns) == SUMMARY_COLUMNS and len(summary) == 7
    assert list(pd.read_parquet(tmp_path / "t1" / "summary.parquet").columns) == SUMMARY_COLUMNS
    assert list(pd.read_csv(tmp_path / "t1" / "failures.csv").columns) == FAILURE_COLUMNS
    assert list(pd.read_csv(tmp_path / "t1" / "grad_dynamics.csv").columns) == GRAD_COLUMNS
    md = (tmp_path / "t1" / "summary.md").read_text().splitlines()
    assert md[0] == "| " + " | ".join(SUMMARY_COLUMNS) + " |" and len(md) == 2 + 7
    row = dict(zip(SUMMARY_COLUMNS, (c.strip() for c in md[-2].strip("| ").split(" | "))))
    assert {k: row[k] for k in ("run_id", "workflow", "seed", "intervention", "base", "peak", "peak_step")} == {
        "run_id": "voting-ip-toy-math-s0", "workflow": "voting", "seed": "0", "intervention": "none",
        "base": "0.400", "peak": "0.700", "peak_step": "20"}  # fmt: skip
    # determinism: a second run (paths in another order) writes identical bytes
    assert aggregate_cli.main(["--runs", *reversed(paths), "--out", str(tmp_path / "t2")]) == 0
    for name in aggregate.OUTPUTS:
        assert (tmp_path / "t1" / name).read_bytes() == (tmp_path / "t2" / name).read_bytes(), name
    assert not [p for p in (tmp_path / "t1").iterdir() if p.name.endswith(".tmp")]


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda root: [], "no runs given"),
        (lambda root: [str(root / "nope" / "metrics.parquet")], "metrics file not found"),
        (lambda root: [_bad(root, pd.DataFrame({"step": [1], "value": [0.5]}))], "lacks columns"),
        (lambda root: [_bad(root, "not parquet")], "not a valid metrics table"),
        (lambda root: [_bad(root, pd.DataFrame(columns=METRIC_COLUMNS))], "has no rows"),
        (lambda root: write_runs(root, samples=False)[:1] * 2, "appears in both"),
        (lambda root: _same_cell_two_presets(root), "are the same cell and seed"),
        (lambda root: _bad_samples(root), "samples table lacks columns"),
    ],
)
def test_aggregate_cli_errors(tmp_path, capsys, make, message):
    with pytest.raises(SystemExit) as exc:
        aggregate_cli.main(["--runs", *make(tmp_path), "--out", str(tmp_path / "out")])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def _bad(root, content) -> str:
    p = root / "bad" / "metrics.parquet"
    p.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(content, str):
        p.write_text(content)
    else:
        content.to_parquet(p)
    return str(p)


def _same_cell_two_presets(root) -> list[str]:
    """A run and its copy under a tagged run id (toy's `...-s0` and toy_long's `...-s0-long`): same factors."""
    rid, df = sorted(build_runs().items())[0]
    p = root / "runs" / f"{rid}-long" / "metrics.parquet"
    write_metrics(df.assign(run_id=f"{rid}-long"), p)
    return [*write_runs(root, samples=False), str(p)]


def _bad_samples(root) -> list[str]:
    paths = write_runs(root, samples=False)
    pd.DataFrame({"run_id": ["x"]}).to_parquet(root / "runs" / CLIFF / "samples.parquet")
    return paths


def test_heldout_peak_is_selected_on_validation_and_read_on_test():
    """The test curve peaks at step 10 and the validation curve at step 20: peak_heldout is the test accuracy
    at step 20 (never the test maximum); a run without validation rows gets NaN; a run whose validation
    accuracy never beats step 0 selects step 0 (gain 0)."""
    steps = [0, 10, 20, 30]
    m = eval_rows("voting-sp-toy-math-s0", steps, [0.30, 0.80, 0.50, 0.40])
    for s, a in zip(steps, [0.2, 0.3, 0.6, 0.5]):
        m += rows(factors("voting-sp-toy-math-s0"), s, "val", "all", {"accuracy": a, "n_eval": 64})
    m += eval_rows("voting-ip-toy-math-s0", steps, [0.30, 0.80, 0.50, 0.40])
    m += eval_rows("single-sp-toy-math-s0", steps, [0.30, 0.80, 0.50, 0.40])
    for s, a in zip(steps, [0.6, 0.5, 0.6, 0.2]):
        m += rows(factors("single-sp-toy-math-s0"), s, "val", "all", {"accuracy": a, "n_eval": 64})
    s = summarize_runs(pd.DataFrame(m)).set_index("run_id")
    assert list(s.reset_index().columns) == SUMMARY_COLUMNS
    r = s.loc["voting-sp-toy-math-s0"]
    assert r.peak == 0.80 and r.peak_heldout_step == 20 and r.peak_heldout == 0.50
    assert r.gain_heldout == pytest.approx(0.20)
    assert pd.isna(s.loc["voting-ip-toy-math-s0", "peak_heldout"])
    assert pd.isna(s.loc["voting-ip-toy-math-s0", "peak_heldout_step"])
    single = s.loc["single-sp-toy-math-s0"]
    assert single.peak_heldout_step == 0 and single.gain_heldout == 0.0


@pytest.mark.slow
def test_evidence_tables_are_regenerated_from_committed_data():
    """Every results/evidence/<experiment>/ holds data with provenance, its tables/*.md are what its
    metrics.parquet renders to, and every table README.md or docs/ quote from it is that rendering."""
    from marlflow.cli import evidence

    folders = sorted(p for p in evidence.EVIDENCE.iterdir() if p.is_dir())
    assert folders, "no committed evidence under results/evidence"
    for folder in folders:
        prov = json.loads((folder / "provenance.json").read_text())
        assert {"commit", "command", "cpu", "torch", "threads", "weights_sha256"} <= set(prov)
        assert prov["commit"] and prov["cpu"]["model"]
        if not (folder / "metrics.parquet").is_file():  # diagnostics: tests/test_induced_diagnostics.py
            continue
        assert evidence.render(folder.name, check=True) == [], folder.name
        # the pipeline's own summary agrees with the data (both read as today's code reads older tables: a
        # factor column added since, e.g. build, at its default)
        s = with_build(pd.read_parquet(folder / "summary.parquet"))[SUMMARY_COLUMNS]
        pd.testing.assert_frame_equal(
            s, summarize_runs(validate_metrics(pd.read_parquet(folder / "metrics.parquet")))
        )
    docs = [evidence.ROOT / "README.md", *sorted((evidence.ROOT / "docs").glob("*.md"))]
    quoted = evidence.quotes(docs)
    assert quoted, "no document quotes an evidence table"
    for where, exp, name, text in quoted:
        assert text == (evidence.EVIDENCE / exp / "tables" / f"{name}.md").read_text(), (where, exp, name)


def test_evidence_render_check_finds_an_edited_table(metrics, tmp_path):
    from marlflow.cli import evidence

    atomic_write_parquet(metrics, tmp_path / "exp" / "metrics.parquet")
    assert set(evidence.render("exp", tmp_path)) == set(evidence.TABLES)
    assert evidence.render("exp", tmp_path, check=True) == []
    (tmp_path / "exp" / "tables" / "claims.md").write_text("edited by hand\n")
    assert evidence.render("exp", tmp_path, check=True) == ["claims"]


def _matrix_doc() -> dict:
    import yaml

    from marlflow.cli import evidence

    return yaml.safe_load((evidence.ROOT / "matrix.yaml").read_text())


def test_intervention_analysis_is_declared_in_the_preset():
    """toy_interventions declares its pooled analysis as a schema key; matrix.analysis_of hands it to aggregate."""
    from marlflow.pipeline.matrix import analysis_of

    ia = analysis_of(_matrix_doc(), "toy_interventions")["interventions"]
    assert ia == {"baseline": "none", "compare": ["kl", "coh", "srn", "cg", "mb"], "statistic": "terminal_mean3",
                  "pair_by": ["workflow", "sharing", "scale", "task", "seed", "build"], "correction": "bonferroni"}  # fmt: skip
    # every toy preset declares its per-problem paired analysis (marlflow.analysis.paired) before its runs
    assert analysis_of(_matrix_doc(), "toy") == {
        "paired": {
            "contrasts": ["sp-ip"],
            "primary": "heldout",
            "correction": "bonferroni",
            "alpha": 0.05,
            "mde": 0.15,
        }
    }
    assert analysis_of(_matrix_doc(), "toy_interventions")["paired"]["contrasts"] == ["sp-ip", "itv-none"]


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            lambda ia: ia.update(compare=["kl", "klx"]),
            r"compare: names 'klx', which is not on the preset's "
            r"intervention axis \(none, kl, coh, srn, cg, mb\)\. Did you mean 'kl'\?",
        ),
        (lambda ia: ia.update(baseline="zz"), r"interventions\.baseline: names 'zz', which is not on"),
        (lambda ia: ia.update(compare=["none", "kl"]), r"compare: lists the baseline 'none'"),
        (
            lambda ia: ia.update(pair_by=["workflow", "seed"]),
            r"pair_by: leaves out sharing, which the preset "
            r"varies.*Add sharing to pair_by",
        ),
        (lambda ia: ia.update(statistic="peak"), r"statistic.*'peak'.*terminal_mean3"),
        (lambda ia: ia.update(correction="holm"), r"correction.*'holm'.*bonferroni"),
        (lambda ia: ia.update(pair_by=["seeds"]), r"pair_by.*'seeds'"),
        (lambda ia: ia.update(alpha=0.1), r"analysis\.interventions.*alpha"),
        (lambda ia: ia.pop("compare"), r"analysis\.interventions.*compare"),
    ],
)
def test_intervention_analysis_declaration_errors(edit, message):
    """A declaration that names what the preset does not run, or that aggregate could not compute, is refused
    when the matrix is read, with the key and the fix."""
    from marlflow.pipeline.matrix import MatrixError, analysis_of

    doc = _matrix_doc()
    edit(doc["presets"]["toy_interventions"]["analysis"]["interventions"])
    with pytest.raises(MatrixError, match=message):
        analysis_of(doc, "toy_interventions")


def test_schema_statistics_are_the_pooled_tables():
    from marlflow.analysis.seeds import CORRECTIONS, INTERVENTION_STATS
    from marlflow.pipeline.matrix import schema

    props = schema()["$defs"]["intervention_analysis"]["properties"]
    assert props["statistic"]["enum"] == list(INTERVENTION_STATS)
    assert props["correction"]["enum"] == list(CORRECTIONS)


def _itv_summary() -> pd.DataFrame:
    """voting-ip/sp toy math, 3 seeds: none, kl (terminal +0.10 +- 0.01, IP only) and cg (no change)."""
    recs = []
    for sh in ("sp", "ip"):
        for seed in range(3):
            for itv, d in (("none", 0.0), ("kl", 0.09 + 0.01 * seed), ("cg", 0.02 * (seed - 1))):
                if itv == "kl" and sh == "sp":
                    continue
                recs.append(dict(run_id=f"voting-{sh}-toy-math-s{seed}-{itv}", workflow="voting", sharing=sh,
                                 scale="toy", task="math", seed=seed, build=0, intervention=itv, n_evals=5,
                                 terminal_mean3=0.5 + d, gain_heldout=0.2 + d, cliff=itv == "none" and seed == 0))  # fmt: skip
    return pd.DataFrame(recs)


def test_interventions_table_is_computed_as_declared(tmp_path):
    """aggregate's interventions table from a declaration: the compared names in order (an absent one still
    counts in the correction), the baseline and the correction named in every row, intervals at 1 - 0.05/m,
    the verdict on the declared statistic; the .md says it was declared, and what; without a declaration the
    heading says the comparison was chosen after the runs."""
    declared = {"baseline": "none", "compare": ["kl", "cg", "mb"], "statistic": "terminal_mean3",
                "pair_by": ["workflow", "sharing", "seed"], "correction": "bonferroni"}  # fmt: skip
    t = aggregate.interventions_table(_itv_summary(), declared)
    assert list(dict.fromkeys(t["intervention"])) == ["kl", "cg", "mb"]
    assert (t["baseline"] == "none").all() and (t["correction"] == "bonferroni").all()
    assert t["ci_level"].tolist() == pytest.approx([1 - 0.05 / 3] * len(t))
    by = t.set_index(["intervention", "stat"])
    assert (
        by.loc[("kl", "terminal_mean3"), "n_pairs"] == 3 and by.loc[("kl", "terminal_mean3"), "n_cells"] == 1
    )
    assert by.loc[("kl", "terminal_mean3"), "mean"] == pytest.approx(0.10)
    assert by.loc[("kl", "terminal_mean3"), "verdict"] == "positive"
    assert (
        by.loc[("cg", "terminal_mean3"), "n_pairs"] == 6
        and by.loc[("cg", "terminal_mean3"), "verdict"] == "inconclusive"
    )
    assert (
        by.loc[("mb", "terminal_mean3"), "n_pairs"] == 0
        and by.loc[("mb", "terminal_mean3"), "verdict"] == "inconclusive"
    )
    assert by.loc[("kl", "gain_heldout"), "verdict"] == "" and by.loc[("kl", "terminal_mean3"), "primary"]
    # another declared statistic carries the verdict; no correction: each interval at 0.95
    other = aggregate.interventions_table(
        _itv_summary(), {**declared, "statistic": "gain_heldout", "correction": "none"}
    )
    o = other.set_index(["intervention", "stat"])
    assert (
        o.loc[("kl", "gain_heldout"), "verdict"] == "positive"
        and o.loc[("kl", "terminal_mean3"), "verdict"] == ""
    )
    assert other["ci_level"].tolist() == pytest.approx([0.95] * len(other)) and list(
        other["stat"][:3]
    ) == list(aggregate.INTERVENTION_STATS[1::-1]) + ["cliff"]
    head = aggregate.interventions_heading(t)
    assert head.startswith("Declared in the preset before the runs (matrix.yaml analysis.interventions: ")
    assert '"compare": ["kl", "cg", "mb"]' in head and "correction: bonferroni" in head
    assert "bonferroni-corrected over the 3 interventions (each at 0.9833)" in head
    post = aggregate.interventions_heading(aggregate.interventions_table(_itv_summary(), None))
    assert post.startswith("Not declared in the preset") and "chosen after the runs" in post


def test_aggregate_refuses_an_analysis_it_cannot_compute(tmp_path, capsys):
    paths = write_runs(tmp_path, samples=False)
    for bad, says in (("[1]", "not a JSON object"), ('{"cells": {}}', "unknown analyses ['cells']"),
                      ('{"interventions": {"compare": ["kl"], "statistic": "peak"}}', "statistic 'peak'")):  # fmt: skip
        with pytest.raises(SystemExit) as e:
            aggregate_cli.main(["--runs", *paths, "--out", str(tmp_path / "t"), "--analysis", bad])
        assert e.value.code == 2 and says in capsys.readouterr().err, bad
    assert not (tmp_path / "t").exists()


def test_evidence_collect_pools_several_checkouts_with_each_commit(tmp_path):
    """toy_seeds' builds are trained in two checkouts: collect pools their runs, computes the summary from the
    pooled data and records each checkout's commit and runs."""
    import subprocess

    from marlflow.cli import evidence

    runs = build_runs()
    halves = [dict(list(runs.items())[:3]), dict(list(runs.items())[3:])]
    folders = []
    for i, part in enumerate(halves):
        repo = tmp_path / f"checkout{i}"
        subprocess.run(["git", "init", "-q", str(repo)], check=True)
        subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q",
                        "--allow-empty", "-m", f"c{i}"], check=True)  # fmt: skip
        for rid, df in part.items():
            (repo / "results" / "runs" / rid).mkdir(parents=True)
            df.to_parquet(repo / "results" / "runs" / rid / "metrics.parquet")
            (repo / "results" / "runs" / rid / "config.json").write_text(
                json.dumps({"run_id": rid, "model": "m"})
            )
        folders.append(repo / "results")
    out = evidence.collect("pooled", folders, "two checkouts", out_root=tmp_path / "evidence")
    prov = json.loads((out / "provenance.json").read_text())
    heads = [subprocess.run(["git", "-C", str(f.parent), "rev-parse", "HEAD"], capture_output=True, text=True,
                            check=True).stdout.strip() for f in folders]  # fmt: skip
    assert prov["commit"] == heads and [s["commit"] for s in prov["sources"]] == heads
    assert [sorted(s["runs"]) for s in prov["sources"]] == [sorted(h) for h in halves]
    pd.testing.assert_frame_equal(
        pd.read_parquet(out / "summary.parquet"), summarize_runs(pd.read_parquet(out / "metrics.parquet"))
    )
    assert evidence.render("pooled", tmp_path / "evidence", check=True) == []


def test_evidence_collect_copies_the_summary_a_preset_wrote_for_exactly_its_runs(tmp_path):
    """A non-default preset's aggregate writes results/presets/<preset>/tables/summary.parquet: collect copies
    that file (as the pipeline wrote it, here marked by a base no recomputation gives) when it covers exactly the
    collected runs, and computes the summary from the metrics when no file does."""
    from marlflow.cli import evidence

    runs = dict(list(build_runs().items())[:2])
    results = tmp_path / "checkout" / "results"
    for rid, df in runs.items():
        (results / "runs" / rid).mkdir(parents=True)
        df.to_parquet(results / "runs" / rid / "metrics.parquet")
        (results / "runs" / rid / "config.json").write_text(json.dumps({"run_id": rid, "model": "m"}))
    written = summarize_runs(pd.concat(runs.values())).assign(base=0.123)
    (results / "presets" / "p" / "tables").mkdir(parents=True)
    written.iloc[:1].to_parquet(
        results / "presets" / "p" / "tables" / "summary.parquet"
    )  # one run: not these
    out = evidence.collect("computed", results, "a test", out_root=tmp_path / "evidence")
    assert (pd.read_parquet(out / "summary.parquet")["base"] != 0.123).all()
    written.to_parquet(results / "presets" / "p" / "tables" / "summary.parquet")
    out = evidence.collect("copied", results, "a test", out_root=tmp_path / "evidence")
    pd.testing.assert_frame_equal(pd.read_parquet(out / "summary.parquet"), written)


def test_evidence_collect_groups_the_runs_environments(tmp_path):
    """provenance.json names where the runs trained (their environment.jsonl, marlflow.training.environment): one entry per
    distinct environment with its hosts and runs, a start that a later fresh start discarded left out, and the
    runs with no record listed apart (their only record is the collecting machine's cpu / torch fields)."""
    from marlflow.cli import evidence
    from marlflow.training import environment

    recorded, older = list(build_runs().items())[:2]
    results = tmp_path / "checkout" / "results"
    for rid, df in (recorded, older):
        (results / "runs" / rid).mkdir(parents=True)
        df.to_parquet(results / "runs" / rid / "metrics.parquet")
        (results / "runs" / rid / "config.json").write_text(json.dumps({"run_id": rid, "model": "m"}))
    (results / "tables").mkdir()
    summarize_runs(pd.concat([recorded[1], older[1]])).to_parquet(results / "tables" / "summary.parquet")
    env = {"cpu_model": "Xeon", "cpu_flags": ["avx2"], "torch": "2.13.0+cpu", "torch_cpu_capability": "AVX512",
           "cuda_device": "", "torch_threads": 2, "omp_num_threads": "1", "ranks": 1, "marlflow": "0.1.0",
           "commit": "abc"}  # fmt: skip
    starts = [
        {
            **env,
            "torch": "2.12.0+cpu",
            "step": 0,
            "time": "t0",
            "hostname": "old",
            "hosts": ["old"],
        },  # discarded
        {**env, "step": 0, "time": "t1", "hostname": "node1", "hosts": ["node1"]},
        {**env, "step": 20, "time": "t2", "hostname": "node2", "hosts": ["node2"]},  # resumed on another node
    ]
    (results / "runs" / recorded[0] / environment.ENVIRONMENT_FILE).write_text(
        "".join(json.dumps(r) + "\n" for r in starts)
    )
    out = evidence.collect("envs", results, "a test", out_root=tmp_path / "evidence")
    prov = json.loads((out / "provenance.json").read_text())
    assert prov["environments"] == [{**env, "hosts": ["node1", "node2"], "runs": [recorded[0]]}]
    assert prov["unrecorded_runs"] == [older[0]]
    assert set(prov["cpu"]) == {"model", "flags", "cores"} and prov["torch"] and "omp_num_threads" in prov


def test_headline_peaks_never_select_on_test_outcomes():
    """Two matrices that differ only in the test accuracy of steps the validation problems did not pick (a
    spike of 0.99 at step 10 in every run) give identical held-out peaks, steps, peak / terminal numbers, SP - IP
    peak contrasts and C3; the in-sample peak moves with the spike."""
    from marlflow.analysis.claims import claims_table
    from marlflow.analysis.seeds import contrasts

    steps = [0, 10, 20, 30, 40]

    def matrix(spike: float) -> pd.DataFrame:
        m = []
        for rid, acc, val in (("voting-sp-toy-math-s0", [0.3, 0.5, 0.6, 0.55, 0.5], [0.3, 0.4, 0.6, 0.5, 0.5]),
                              ("voting-ip-toy-math-s0", [0.3, 0.5, 0.7, 0.65, 0.6], [0.3, 0.4, 0.5, 0.7, 0.6])):  # fmt: skip
            m += eval_rows(rid, steps, [spike if s == 10 else a for s, a in zip(steps, acc)]) + val_rows(
                rid, steps, val
            )
        return pd.DataFrame(m)

    plain, spiked = summarize_runs(matrix(0.5)), summarize_runs(matrix(0.99))
    cols = ["run_id", "peak_heldout_step", "peak_heldout", "gain_heldout", "terminal"]
    pd.testing.assert_frame_equal(plain[cols], spiked[cols])
    assert (
        (plain["peak"] < 0.9).all() and (spiked["peak"] == 0.99).all() and (spiked["peak_step"] == 10).all()
    )
    # the numbers of the peak / terminal table stay; only its cliff mark may change: the cliff flag is a test
    # on the test problems (calibrated over every candidate peak), which the spike then fails
    unmarked = [peak_terminal_table(s).map(lambda v: v.replace(" †", "")) for s in (plain, spiked)]
    pd.testing.assert_frame_equal(*unmarked)
    heldout = [c[c["stat"].isin(["peak_heldout", "gain_heldout"])].reset_index(drop=True)
               for c in (contrasts(plain), contrasts(spiked))]  # fmt: skip
    pd.testing.assert_frame_equal(*heldout)
    assert heldout[0].set_index("stat").loc["peak_heldout", "mean"] == pytest.approx(0.6 - 0.65)
    c3 = [claims_table(s, pd.DataFrame(columns=GRAD_COLUMNS)).set_index("claim").loc["C3", "value"]
          for s in (plain, spiked)]  # fmt: skip
    assert c3[0] == c3[1] == pytest.approx(0.05)


def test_run_pairs_keep_builds_apart():
    """The gradient figures pair each SP run with the IP run of its own cell, seed and toy build: two builds of
    one cell are two pairs, not one pair overwritten by the other build."""
    from marlflow.analysis.plots import run_pairs

    rows = [{"run_id": f"voting-{sh}-toy-math-s0{b}", "workflow": "voting", "sharing": sh, "scale": "toy",
             "task": "math", "seed": 0, "build": int(bool(b)), "intervention": "none"}
            for b in ("", "-b1") for sh in ("sp", "ip")]  # fmt: skip
    pairs = run_pairs(pd.DataFrame(rows))
    assert pairs == [{"sp": "voting-sp-toy-math-s0", "ip": "voting-ip-toy-math-s0"},
                     {"sp": "voting-sp-toy-math-s0-b1", "ip": "voting-ip-toy-math-s0-b1"}]  # fmt: skip
    no_build = pd.DataFrame(rows[:2]).drop(columns="build")  # tables from before the build axis
    assert run_pairs(no_build) == pairs[:1]

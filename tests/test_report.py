"""Tests for marlflow.report.build: the output contract, the overview and run pages, figures, errors, and the
pages rendered in headless Chromium (not blank, no table wider than the page).

The runs are synthetic metrics/samples tables in the real schema (the rows trainer.py logs: per-role train
metrics, the step-time split, accuracy with accuracy_se, the toy tasks' solution metric careless_share, samples
with chat-template prompts),
each in a run folder with config.json and DONE as Snakemake leaves them.
"""

from __future__ import annotations

import base64
import html
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from marlflow.cli import aggregate as aggregate_cli
from marlflow.cli import report as report_cli
from marlflow.report import build as report
from marlflow.report import findings
from marlflow.report import html as report_html
from marlflow.store.atomic import atomic_write_parquet
from marlflow.store.schema import SAMPLE_COLUMNS, rows, write_metrics

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
HOSTILE = "<script>alert('x')</script> & </pre></details>"


def make_run(
    root: Path,
    run_id: str,
    acc: list[float],
    shares: dict[str, float],
    careless=None,
    format_failure: dict[str, list[float]] | None = None,
    zero_steps: tuple[int, ...] = (),
    share_gaps: tuple[int, ...] = (),
    val: list[float] | None = None,
    task_name: str | None = None,
) -> str:
    """A run folder with metrics.parquet, samples.parquet, config.json and DONE; returns the metrics path.

    format_failure: role -> its eval format_failure_rate per eval (default 0.1 throughout); zero_steps: train
    steps where every role's grad_norm and grad_share are 0; share_gaps: train steps where the first role logs no grad_share;
    val: the validation accuracy per eval (default: acc, so the held-out peak step is the test argmax);
    task_name: the registered task in config.json (default toy_<task>)."""
    workflow, sharing, scale, task, seed = run_id.split("-")
    fac = dict(run_id=run_id, workflow=workflow, sharing=sharing, scale=scale, task=task, seed=int(seed[1:]),
               build=0, intervention="none")  # fmt: skip
    recs, samples = [], []
    n = 200
    for k, a in enumerate(acc):
        step = 10 * k
        vals = {"accuracy": a, "accuracy_se": (a * (1 - a) / n) ** 0.5, "n_eval": n, "time_eval": 5.0}
        if careless is not None:
            vals["careless_share"] = careless[k]
        recs += rows(fac, step, "eval", "all", vals)
        recs += rows(fac, step, "val", "all", {"accuracy": (val or acc)[k], "n_eval": 64})
        for role in shares:
            ff = (format_failure or {}).get(role, [0.1] * len(acc))[k]
            recs += rows(fac, step, "eval", role, {"format_failure_rate": ff, "completion_length": 20.0 + k})
        for ep in range(2):
            reward = float(ep == 0)
            for slot, role in enumerate(shares):
                samples.append({**fac, "step": step, "episode": ep, "uid": f"p{ep}", "slot": f"{role}{slot}",
                                "role": role, "prompt": f"<|im_start|>user\nWhat is 8-5+7? {HOSTILE}",
                                "output": f"\\boxed{{10}} {HOSTILE}", "reward": reward,
                                "format_failure": slot == 1})  # fmt: skip
    for step in range(1, 10 * (len(acc) - 1) + 1):
        for i, (role, share) in enumerate(shares.items()):
            zero = step in zero_steps  # no gradient: norm 0 and, as algos.grad_shares gives, share 0
            vals = {"grad_norm": 0.0 if zero else 1.0 + step * share, "grad_share": 0.0 if zero else share,
                    "reward_mean": 0.3 + 0.01 * step, "completion_length": 30.0}  # fmt: skip
            if i == 0 and step in share_gaps:
                del vals["grad_share"]
            recs += rows(fac, step, "train", role, vals)
        recs += rows(fac, step, "train", "all", {"reward_mean": 0.3 + 0.01 * step, "step_time": 2.0,
                     "time_generate": 1.2, "time_score": 0.1, "time_backward": 0.5, "time_other": 0.2})  # fmt: skip
    folder = root / "runs" / run_id
    write_metrics(pd.DataFrame(recs), folder / "metrics.parquet")
    atomic_write_parquet(pd.DataFrame(samples, columns=SAMPLE_COLUMNS), folder / "samples.parquet")
    cfg = {"run_id": run_id, "preset": "toy", "model": "/abs/models/toy", "scale": scale,
           "grpo": {"steps": 10 * (len(acc) - 1), "group_size": 8}, "task": {"name": task_name or f"toy_{task}"}}  # fmt: skip
    (folder / "config.json").write_text(json.dumps(cfg))
    (folder / "DONE").write_text(json.dumps({"run_id": run_id, "final_accuracy": acc[-1]}))
    return str(folder / "metrics.parquet")


@pytest.fixture
def runs(tmp_path) -> list[str]:
    return [
        make_run(
            tmp_path,
            "voting-ip-toy-math-s0",
            [0.3, 0.6, 0.4],
            {"generator": 0.75, "aggregator": 0.25},
            careless=[0.7, 0.2, 0.1],
        ),  # fmt: skip
        make_run(
            tmp_path,
            "voting-sp-toy-math-s0",
            [0.3, 0.4, 0.45],
            {"generator": 0.6, "aggregator": 0.4},
            careless=[0.7, 0.5, 0.4],
        ),  # fmt: skip
        make_run(
            tmp_path, "single-sp-toy-math-s0", [0.3, 0.35, 0.35], {"generator": 1.0}, careless=[0.6, 0.6, 0.5]
        ),  # fmt: skip
        make_run(
            tmp_path,
            "orch_workers-sp-toy-code-s0",
            [0.5, 0.9, 0.95],
            {"orchestrator": 0.1, "worker": 0.7, "synthesizer": 0.2},
        ),  # fmt: skip
    ]


def build(tmp_path: Path, runs: list[str], name: str = "out", commit: str = "abc123") -> dict[str, Path]:
    tables = tmp_path / "tables"
    if not (tables / "summary.parquet").is_file():
        assert aggregate_cli.main(["--runs", *runs, "--out", str(tables)]) == 0
    out = tmp_path / name
    return report.make_report(tables, runs, out / "figures", out / "report.html", commit=commit)


def run_ids(runs: list[str]) -> list[str]:
    return [Path(p).parent.name for p in runs]


@pytest.mark.slow
def test_outputs_contract_and_cli(tmp_path, runs, capsys):
    tables = tmp_path / "tables"
    assert aggregate_cli.main(["--runs", *runs, "--out", str(tables)]) == 0
    html_path, figs = tmp_path / "r" / "report.html", tmp_path / "r" / "figures"
    assert report_cli.main(["--tables", str(tables), "--runs", *runs, "--figures", str(figs), "--html",
                        str(html_path)]) == 0  # fmt: skip
    assert f"report: {html_path.resolve()}" in capsys.readouterr().out
    expected = report.outputs(figs, html_path, None, run_ids(runs), solution_metrics=True)  # toy tasks
    written = sorted(p for p in (tmp_path / "r").rglob("*") if p.is_file())
    assert written == sorted(expected)  # every file written is in the contract, and every one is written
    assert report.default_pages_dir(html_path) == tmp_path / "r" / "report"
    assert not (figs / "interventions.png").exists()  # no intervention: no placeholder figure
    assert (figs / report.SOLUTION_FIGURE).exists()
    for path in expected[: len(report.FIGURES) - 1]:
        assert path.read_bytes().startswith(PNG_MAGIC), path


@pytest.mark.slow
def test_overview_page(tmp_path, runs):
    written = build(tmp_path, runs)
    page = written["report.html"].read_text()
    embedded = re.findall(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', page)
    assert len(embedded) == 4  # curves, solution metrics (careless_share), grad norm, role share
    assert base64.b64decode(embedded[0]) == written["curves.png"].read_bytes()
    for text in ("Provenance", "abc123", "trl ", "torch ", "Failure signatures", "Gradient traces",
                 "Definitions", "Peak / terminal", "careless_share", "0.70 -&gt; 0.10"):  # fmt: skip
        assert text in page, text
    # every failure signature is shown with its evidence, item by item
    failures = pd.read_csv(tmp_path / "tables" / "failures.csv", keep_default_na=False)
    flagged = failures[failures["cliff"] | failures["stagnation"]]
    assert set(flagged["run_id"]) == {"voting-ip-toy-math-s0", "single-sp-toy-math-s0"}
    for evidence in flagged["evidence"]:
        for item in evidence.split("; "):
            assert f"<li>{html.escape(item)}</li>" in page, item
    # wall time = sum of step_time: 20 steps x 2.0 s x 4 runs
    assert "2.7 min total; per run 40.0 s to 40.0 s" in page  # 160 s
    # evaluation = sum of time_eval: 3 evals x 5.0 s x 4 runs = 60 s, 60 / (60 + 160) of the time
    assert "60.0 s total, 27% of training plus evaluation" in page
    assert "preset</td><td>toy" in page
    # real tables, no markdown in <pre>
    assert "|---|" not in page and page.count("<table") >= 5
    assert "http" not in page.replace("<!DOCTYPE html>", "")  # self-contained
    for rid in run_ids(runs):
        assert f'href="report/{rid}.html"' in page
    # seed-paired SP - IP from the statistics step: voting peak 0.45 - 0.60; one seed, so no CI: the banner
    # says so once instead of an n/a under every number
    assert re.search(r"<td>voting toy math</td><td class=\"n\">1</td><td>\+0.000</td><td>-0.150</td>", page)
    assert "<span class='ci'>n/a</span>" not in page and page.count("One seed per cell") == 1
    # deterministic for the same inputs
    again = build(tmp_path, runs, name="again")
    assert again["report.html"].read_bytes() == written["report.html"].read_bytes()


@pytest.mark.slow
def test_statistics_tables_absent_or_torn(tmp_path, runs):
    tables = tmp_path / "tables"
    aggregate_cli.main(["--runs", *runs, "--out", str(tables)])
    for name in ("contrasts.csv", "summary_by_cell.csv", "claims.csv"):
        (tables / name).unlink()  # tables from an older aggregate step: the page says so instead of failing
    page = build(tmp_path, runs)["report.html"].read_text()
    for name in ("contrasts.csv", "summary_by_cell.csv", "claims.csv"):
        assert f"{name} was not found next to summary.parquet" in page, name
    (tables / "claims.csv").write_text('a,"b\n')  # a torn CSV is an error naming the file
    with pytest.raises(ValueError, match="claims.csv: not a readable CSV"):
        build(tmp_path, runs, name="bad")
    (tables / "claims.csv").write_text("a,b\n1,2\n")  # a CSV of another layout names its missing columns
    with pytest.raises(ValueError, match=r"claims.csv lacks columns \['claim', 'verdict'\]"):
        build(tmp_path, runs, name="bad2")


@pytest.mark.slow
def test_run_page(tmp_path, runs):
    written = build(tmp_path, runs)
    p = written["pages/voting-ip-toy-math-s0.html"]
    page = p.read_text()
    assert "<script>" not in page and "&lt;script&gt;alert(&#x27;x&#x27;)&lt;/script&gt;" in page
    assert "&lt;|im_start|&gt;user" in page
    for text in ("Per-role metrics", "Step-time split", "time_generate", "time_backward", "Sample transcripts",
                 "step 20</b>: 2 episodes", "aggregator1", "format failure", "config.json", "/abs/models/toy"):  # fmt: skip
        assert text in page, text
    # calls in logged order within an episode: generator0 before aggregator1
    assert page.index("<b>generator0</b>") < page.index("<b>aggregator1</b>")
    # step-time split: generate is 1.2 of 2.0 s per step
    assert re.search(r"<td>time_generate</td><td class=\"n\">24.000</td><td class=\"n\">0.600</td>", page)
    assert '<a href="../report.html">overview</a>' in page.replace("'", '"')
    assert len(re.findall(r'src="data:image/png;base64,', page)) == 2
    assert "http" not in page.replace("<!DOCTYPE html>", "")


def test_curves_share_y_per_task_with_se_bands(runs):
    from marlflow.analysis import load_runs
    from marlflow.analysis.plots import plot_curves, plot_grad_norm, plot_role_share

    metrics, _ = load_runs(runs)
    fig = plot_curves(metrics)
    titles = [ax.get_title() for ax in fig.axes]
    assert titles == ["single / math", "single / code", "voting / math", "voting / code", "orch_workers / math",
                      "orch_workers / code"]  # fmt: skip
    ylims = {t: ax.get_ylim() for t, ax in zip(titles, fig.axes)}
    assert ylims["single / math"] == ylims["voting / math"] == ylims["orch_workers / math"]
    assert ylims["single / code"] == ylims["orch_workers / code"] != ylims["voting / math"]
    lo, hi = ylims["voting / math"]
    assert lo <= 0.3 - (0.3 * 0.7 / 200) ** 0.5 and hi >= 0.6 + (0.6 * 0.4 / 200) ** 0.5  # bands fit
    voting = fig.axes[titles.index("voting / math")]
    assert len(voting.lines) == 4 and len(voting.collections) == 2  # 2 runs: curve + base line, one SE band
    band = voting.collections[0].get_paths()[0].vertices[:, 1]
    assert band.min() == pytest.approx(0.3 - (0.3 * 0.7 / 200) ** 0.5)
    # gradient figures: SP panel left of its IP partner, sharing y; single has no partner
    for plot in (plot_grad_norm, plot_role_share):
        axes = plot(metrics).axes
        names = [ax.get_title() for ax in axes]
        assert names == ["single-sp-toy-math-s0", "voting-sp-toy-math-s0", "voting-ip-toy-math-s0",
                         "orch_workers-sp-toy-code-s0"]  # fmt: skip
        assert axes[1].get_ylim() == axes[2].get_ylim()
        assert axes[2].get_position().x0 > axes[1].get_position().x0


@pytest.mark.slow
def test_intervention_traces_and_contrast_section(runs, tmp_path):
    """With an intervention run beside its none partner: the traces figure has a row per role of that cell
    (a line per intervention, seed means), the overview gets the Interventions - none table and the figure;
    without one, a placeholder figure and no section."""
    from marlflow.analysis import load_runs
    from marlflow.analysis.plots import ITV_TRACES, plot_interventions

    metrics, _ = load_runs(runs)
    assert [t.get_text() for ax in plot_interventions(metrics).axes for t in ax.texts] == [
        "no runs with an intervention"
    ]
    page = (build(tmp_path, runs)["report.html"]).read_text()
    assert "Interventions - none" not in page and "intervention_traces" not in page
    assert "No interventions in this matrix" in page
    cg = pd.read_parquet(runs[0])  # voting-ip-toy-math-s0, now also run with cliff_guard
    cg["run_id"], cg["intervention"] = "voting-ip-toy-math-s0-cg", "cg"
    cg.loc[cg["metric"] == "grad_norm", "value"] *= 0.5
    path = tmp_path / "runs" / "voting-ip-toy-math-s0-cg" / "metrics.parquet"
    write_metrics(cg, path)
    for name in ("samples.parquet", "config.json", "DONE"):
        shutil.copy(Path(runs[0]).parent / name, path.parent / name)
    both = [*runs, str(path)]
    metrics, _ = load_runs(both)
    fig = plot_interventions(metrics)
    assert [ax.get_title() for ax in fig.axes][:: len(ITV_TRACES)] == ["voting-ip math aggregator",
                                                                       "voting-ip math generator"]  # fmt: skip
    norm = fig.axes[3]  # generator grad_norm: none and cg
    assert len(norm.lines) == 2
    assert norm.lines[1].get_ydata()[5] == pytest.approx(0.5 * norm.lines[0].get_ydata()[5])
    assert [t.get_text() for t in fig.axes[4].texts] == ["not logged"]  # proj_share was not logged here
    written = build(tmp_path / "with_cg", both)
    page = written["report.html"].read_text()
    assert "Interventions - none" in page and "id='intervention_traces'" in page
    # the pooled table aggregate computed (no declaration was passed: every intervention against none)
    pooled = page[page.index("id='pooled_interventions'") : page.index("id='intervention_traces'")]
    for text in ('<td>cg - none</td><td>terminal_mean3</td><td class="n">1</td>', "<td>bonferroni</td>",
                 "<td>inconclusive</td>"):  # fmt: skip
        assert text in pooled, text
    assert "No interventions in this matrix" not in page
    out = tmp_path / "with_cg" / "out"
    assert sorted(written.values()) == sorted(
        report.outputs(
            out / "figures",
            out / "report.html",
            None,
            run_ids(both),
            interventions=True,
            solution_metrics=True,
        )
    )


@pytest.fixture(scope="module")
def toy_runs(tmp_path_factory, toy_model_dir) -> list[str]:
    """Two real 2-step toy runs (voting SP and IP) trained here, each folder with the config.json Snakemake
    writes beside the run's outputs."""
    from marlflow.cli import train
    from marlflow.core.config import GRPOParams, RunConfig, TaskSpec

    root = tmp_path_factory.mktemp("toy-runs")
    paths = []
    for sharing in ("sp", "ip"):
        grpo = GRPOParams(steps=2, problems_per_step=2, group_size=4, learning_rate=1e-2, warmup_steps=0,
                          lr_scheduler="constant", eval_every=1, save_every=2, max_completion_length=12,
                          max_prompt_length=256, lora_r=4, lora_alpha=8)  # fmt: skip
        cfg = RunConfig(run_id=f"voting-{sharing}-toy-math-s0", workflow="voting", sharing=sharing, scale="toy",
                        task_axis="math", seed=0, task=TaskSpec(name="toy_math", eval_size=6, train_size=50),
                        model=str(toy_model_dir), grpo=grpo)  # fmt: skip
        out = root / "runs" / cfg.run_id
        out.mkdir(parents=True)
        (out / "config.json").write_text(json.dumps(cfg.to_dict()))
        train.run(cfg, out)
        paths.append(str(out / "metrics.parquet"))
    return paths


@pytest.mark.slow
def test_report_from_real_toy_runs(tmp_path, toy_runs):
    written = build(tmp_path, toy_runs)
    assert sorted(written.values()) == sorted(
        report.outputs(
            tmp_path / "out" / "figures",
            tmp_path / "out" / "report.html",
            None,
            run_ids(toy_runs),
            solution_metrics=True,
        )
    )
    overview = written["report.html"].read_text()
    for text in ("preset</td><td>toy", "voting-sp-toy-math-s0", "voting-ip-toy-math-s0", "careless_share"):
        assert text in overview, text
    page = written["pages/voting-ip-toy-math-s0.html"].read_text()
    # the real prompts carry the chat template's markup, escaped
    assert "&lt;|im_start|&gt;" in page and "<|im_start|>" not in page
    for text in ("any_correct", "generator_accuracy", "time_generate", "zero_adv_group_frac",
                 "step 2</b>: 4 episodes", "<b>aggregator0</b> (aggregator)"):  # fmt: skip
        assert text in page, text
    samples = pd.read_parquet(Path(toy_runs[1]).with_name("samples.parquet"))
    assert page.count("<div class='call'>") == len(samples)  # every logged call is shown


def test_report_needs_tables(tmp_path, runs, capsys):
    argv = ["--tables", str(tmp_path / "none"), "--runs", *runs, "--figures", str(tmp_path / "f"),
            "--html", str(tmp_path / "r.html")]  # fmt: skip
    with pytest.raises(SystemExit) as exc:
        report_cli.main(argv)
    assert exc.value.code == 2 and "run `python -m marlflow aggregate` first" in capsys.readouterr().err
    assert not (tmp_path / "r.html").exists()


def test_report_needs_runs(tmp_path, runs, capsys):
    aggregate_cli.main(["--runs", *runs, "--out", str(tmp_path / "t")])
    with pytest.raises(SystemExit):
        report_cli.main(
            ["--tables", str(tmp_path / "t"), "--figures", str(tmp_path / "f"), "--html", str(tmp_path / "r")]
        )
    assert "no runs given" in capsys.readouterr().err


def test_bad_config_json_is_named(tmp_path, runs):
    Path(runs[0]).with_name("config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"voting-ip-toy-math-s0/config.json: not valid JSON"):
        build(tmp_path, runs)


# ---------------------------------------------------------------------------- findings, figures


@pytest.fixture
def signal_runs(tmp_path) -> list[str]:
    """Runs with what the findings box reports: a Voting IP run whose aggregator's format failures rise
    0.09 -> 0.80 and that falls off a cliff, with zero-gradient steps and steps where one role logs no share;
    Orch-Workers runs whose toy base 0.07 is below the designed band. In three runs the validation problems
    pick another step than the test maximum (voting-ip: step 20, not 10; voting-sp and orch_workers-sp: step
    10, not 20), so every peak the box shows tells which of the two it read."""
    return [
        make_run(tmp_path, "voting-ip-toy-math-s0", [0.3, 0.6, 0.4], {"generator": 0.75, "aggregator": 0.25},
                 careless=[0.7, 0.2, 0.1], format_failure={"aggregator": [0.09, 0.5, 0.8]}, zero_steps=(3, 4),
                 share_gaps=(6, 7), val=[0.3, 0.35, 0.5]),
        make_run(tmp_path, "voting-sp-toy-math-s0", [0.3, 0.4, 0.45], {"generator": 0.6, "aggregator": 0.4},
                 careless=[0.7, 0.5, 0.4], val=[0.3, 0.5, 0.4]),
        make_run(tmp_path, "orch_workers-sp-toy-math-s0", [0.07, 0.3, 0.5],
                 {"orchestrator": 0.1, "worker": 0.7, "synthesizer": 0.2}, careless=[0.5, 0.3, 0.2],
                 val=[0.07, 0.4, 0.3]),
        make_run(tmp_path, "orch_workers-ip-toy-math-s0", [0.07, 0.2, 0.25],
                 {"orchestrator": 0.1, "worker": 0.7, "synthesizer": 0.2}, careless=[0.5, 0.5, 0.5]),
    ]  # fmt: skip


def findings_box(page: str) -> str:
    start = page.index("<section id='findings'")
    return page[start : page.index("</section>", start)]


@pytest.mark.slow
def test_findings_box(tmp_path, signal_runs):
    # one run on the model marlflow ships, the others on a rebuilt one (another CPU, another hash)
    from marlflow.models.loading import SHIPPED_TOY

    rebuilt = tmp_path / "rebuilt-toy"
    rebuilt.mkdir()
    (rebuilt / "warmstart.json").write_text(json.dumps({"weights_sha256": "f2d79678" + "0" * 56, "torch": "2.13.0+cpu",
        "threads": 2, "cpu_model": "AMD EPYC 9R14", "cpu_flags": ["avx2", "avx512f", "avx512_bf16"]}))  # fmt: skip
    for i, path in enumerate(signal_runs):
        cfg_path = Path(path).with_name("config.json")
        cfg = json.loads(cfg_path.read_text())
        cfg.update(model=str(SHIPPED_TOY if i == 0 else rebuilt), threads=1)
        cfg_path.write_text(json.dumps(cfg))
    # the first run says where it trained (marlflow.training.environment), the others recorded nothing
    env = {"cpu_model": "AMD EPYC 9R14", "cpu_flags": ["avx2", "avx512f", "avx512_bf16"], "torch": "2.13.0+cpu",
           "torch_cpu_capability": "AVX512", "cuda_device": "", "torch_threads": 1, "omp_num_threads": "1",
           "ranks": 1, "marlflow": "0.1.0", "commit": "abc"}  # fmt: skip
    Path(signal_runs[0]).with_name("environment.jsonl").write_text(
        json.dumps({**env, "step": 0, "time": "t", "hostname": "node7", "hosts": ["node7"]}) + "\n"
    )
    page = build(tmp_path, signal_runs)["report.html"].read_text()
    box = findings_box(page)
    assert page.index("id='findings'") < page.index("id='provenance'") < page.index("id='runs'")
    # one seed: the banner says how to get CIs, once, and no table shows n/a
    assert (
        "One seed per cell" in box
        and "<code>snakemake --profile profiles/local --config seeds=[0,1,2]</code>" in box
    )
    assert page.count("One seed per cell") == 1 and "<span class='ci'>n/a</span>" not in page
    for text in (
        # best and worst cell: base, held-out peak (step chosen on validation), terminal, and that it is one seed;
        # the test maximum (orch_workers-sp 0.500 at step 20, voting-ip 0.600 at step 10) would rank and read
        # otherwise
        "Largest gain (held-out peak - base)</b>: orch_workers-sp toy math: base 0.070, held-out peak 0.300 "
        "(step 10), terminal 0.500 (one seed)",
        "Smallest terminal gain (terminal - base)</b>: voting-ip toy math: base 0.300, held-out peak 0.400 "
        "(step 20), terminal 0.400 (one seed)",
        # SP - IP per workflow x task of the held-out peaks (test maxima: -0.150, +0.250), with the noise of one
        # pair: 2 sqrt(se_SP^2 + se_IP^2), each se the test evaluation's at the held-out step
        "one seed pair each, so no CI; eval noise = 2 x the SE of the two test evals at the held-out peaks",
        "voting toy math: held-out peak +0.000, terminal -0.050: peaks within eval noise (0.098)",
        "orch_workers toy math: held-out peak +0.050, terminal +0.117: peaks within eval noise (0.089)",
        # the cliff with the test's drop and the held-out peak, the format-failure rise with values and steps
        "1 of 4 runs: voting-ip-toy-math-s0 (drop 0.200, SE ",
        "; held-out peak 0.400 at step 20 -&gt; 0.433 over the last 3 evals)",
        "voting-ip-toy-math-s0: the aggregator&#x27;s format-failure rate rises 0.09 (step 0) -&gt; 0.80 (step 20)",
        # the toy bases below the band
        "2 of 4 toy bases are outside the designed band [0.15, 0.70] (orch_workers-ip-toy-math-s0 0.070, "
        "orch_workers-sp-toy-math-s0 0.070)",
    ):
        assert text in box, text
    # the peak / terminal table reads the held-out peaks (voting-ip 0.400, not its test maximum 0.600), under a
    # caption that says so and no longer describes the old "peak - terminal >= 5 points" rule
    pt = page[page.index("<h2 id='peak_terminal'>") : page.index("<h2 id='paired'>")]
    assert "Peak: the held-out peak (step selected on validation problems, accuracy on test)" in pt
    assert ">40.0 / 40.0 †<" in pt and ">30.0 / 50.0<" in pt and "60.0 /" not in pt and "5 points" not in page
    # the Runs table: the held-out peak first; the test maximum only as the labelled in-sample column
    head = page.replace("_<wbr>", "_")
    assert "<th>peak_heldout</th><th>peak_heldout_step</th>" in head and "<th>peak_in_sample</th>" in head
    assert "in-sample, optimistic; no finding uses it" in page
    # provenance: the machine, torch, threads and each toy model's hash, CPU and whether it is the shipped one
    shipped = json.loads((SHIPPED_TOY / "warmstart.json").read_text())["weights_sha256"]
    others = sorted(
        json.loads(Path(p).with_name("config.json").read_text())["run_id"] for p in signal_runs[1:]
    )
    for text in ("CPU where 1 of 4 runs trained (environment.jsonl)</td><td>AMD EPYC 9R14 (AVX512-BF16, AVX512, "
                 "AVX2); torch kernels: AVX512; torch 2.13.0+cpu; 1 torch thread(s); hosts node7",
                 f"runs that recorded no environment.jsonl</td><td>{', '.join(others)}",
                 "CPU (where the report was built)", "torch kernels: ", "torch threads per run (config.json)</td><td>1",
                 f"weights_sha256 {shipped}, the model marlflow ships",
                 f"weights_sha256 f2d79678{'0' * 56}, not the shipped model ({shipped[:16]}...)",
                 "built on AMD EPYC 9R14 (AVX512-BF16, AVX512, AVX2) with torch 2.13.0+cpu, 2 threads",
                 "toy bases in the designed band [0.15, 0.70]</td><td>2 of 4"):  # fmt: skip
        assert text in page, text
    # contrasts.md: the banner, then a row per contrast x cell (2 here) instead of a row per statistic with n/a
    md = (tmp_path / "tables" / "contrasts.md").read_text()
    assert md.startswith("One seed per cell") and "n/a" not in md
    assert len([line for line in md.splitlines() if line.startswith("| sp-ip")]) == 2
    for name in ("summary_by_cell.md", "claims.md"):  # the same banner, and no "mean [n/a]" cells
        text = (tmp_path / "tables" / name).read_text()
        assert text.startswith("One seed per cell") and "[n/a]" not in text, name


@pytest.mark.slow
def test_findings_with_seeds(tmp_path):
    """Two seeds per cell: no banner, the SP - IP lines carry their 95% CI and which side it favours, the
    cells their range over seeds, and the .md tables their CIs."""
    runs = [make_run(tmp_path, f"voting-{sh}-toy-math-s{seed}", acc, {"generator": 0.6, "aggregator": 0.4})
            for sh, seed, acc in (("sp", 0, [0.3, 0.4, 0.45]), ("ip", 0, [0.3, 0.6, 0.6]),
                                  ("sp", 1, [0.3, 0.41, 0.45]), ("ip", 1, [0.3, 0.61, 0.6]))]  # fmt: skip
    page = build(tmp_path, runs)["report.html"].read_text()
    box = findings_box(page)
    assert "One seed per cell" not in page and "2 seeds per cell: read differences as indications" in box
    assert (
        "voting toy math: held-out peak -0.155 [-0.219, -0.091]: IP higher" in box
        and "]: IP higher" in box
        and "(2 seed pairs)" in box
    )
    assert (
        "voting-ip toy math: base 0.300 (0.300-0.300), held-out peak 0.605 (0.600-0.610) (step 10, 10), terminal 0.600 (0.600-0.600) (range over 2 seeds)"
        in box
    )
    md = (tmp_path / "tables" / "contrasts.md").read_text()
    assert "One seed per cell" not in md and "-0.155 [-0.219, -0.091]" in md


@pytest.mark.slow
def test_solution_metrics_only_where_the_tasks_have_them(tmp_path):
    """Runs of tasks without solution metrics (smol_math: no `careless` test, no `solution_metrics`) get no
    solution-metrics figure, declared or written, and a page that names no toy-only metric but says there are
    none; the same runs as toy_math runs that log careless_share get the figure, the section and the Runs
    column with step 0 -> last."""
    shares = {"generator": 0.6, "aggregator": 0.4}
    cells = (("sp", [0.3, 0.4, 0.45]), ("ip", [0.3, 0.6, 0.6]))
    smol = [make_run(tmp_path / "smol", f"voting-{sh}-smol-math-s0", acc, shares, task_name="smol_math")
            for sh, acc in cells]  # fmt: skip
    written = build(tmp_path / "smol", smol)
    assert sorted(written.values()) == sorted(
        report.outputs(tmp_path / "smol" / "out" / "figures", written["report.html"], None, run_ids(smol))
    )
    assert report.SOLUTION_FIGURE not in written
    page = written["report.html"].read_text()
    assert "careless" not in page.lower()
    assert "None: these runs' tasks (smol_math) define no metrics of their solver outputs" in page
    toy = [make_run(tmp_path / "toy", f"voting-{sh}-toy-math-s0", acc, shares, careless=[0.7, 0.4, 0.2])
           for sh, acc in cells]  # fmt: skip
    written = build(tmp_path / "toy", toy)
    assert written[report.SOLUTION_FIGURE].read_bytes().startswith(PNG_MAGIC)
    page = written["report.html"].read_text()
    assert "<h2 id='solution'>Solution metrics</h2>" in page and 'alt="solution_metrics.png"' in page
    assert "<th>careless_<wbr>share</th>" in page and "<td>0.70 -&gt; 0.20</td>" in page


def test_run_figure_draws_the_solution_metrics_it_is_given(runs):
    """A run page's eval panel draws its task's solution metrics (report passes the task's names), no others."""
    from marlflow.analysis import load_runs
    from marlflow.analysis.plots import plot_run

    metrics, _ = load_runs(runs[:1])  # voting-ip-toy-math-s0, logs careless_share

    def labels(fig):
        return fig.axes[0].get_legend_handles_labels()[1]

    assert "careless_share" in labels(plot_run(metrics, ["careless_share"]))
    assert "careless_share" not in labels(plot_run(metrics)) and "accuracy" in labels(plot_run(metrics))


def test_replicates_wording_names_builds():
    """A cell's range counts replicates: over seeds alone it says seeds, over several toy builds it says so."""
    one_build = pd.DataFrame({"seed": [0, 1], "build": [0, 0]})
    two_builds = pd.DataFrame({"seed": [0, 0], "build": [0, 1]})
    assert findings._seeds(one_build) == "range over 2 seeds"
    assert findings._seeds(two_builds) == "range over 2 replicates (seeds x builds)"
    assert findings._seeds(two_builds.iloc[:1]) == "one seed"


def test_sp_ip_lines_largest_first_and_capped():
    """More cells than fit the box: the largest |SP - IP| peak differences first, the rest counted."""
    from marlflow.analysis.seeds import contrasts

    recs = []
    for k, (wf, task) in enumerate(
        (w, t) for w in ("eval_opt", "voting", "orch_workers") for t in ("math", "code")
    ):
        for scale in ("toy", "smol"):
            for sharing, peak in (("sp", 0.5), ("ip", 0.5 + 0.01 * k + (0.2 if scale == "smol" else 0))):
                recs.append(dict(run_id=f"{wf}-{sharing}-{scale}-{task}-s0", workflow=wf, sharing=sharing, scale=scale,
                                 task=task, seed=0, intervention="none", base=0.3, peak=0.9, peak_confirmed=peak,
                                 peak_heldout=peak, gain_heldout=peak - 0.3, peak_heldout_step=10,
                                 terminal=peak, terminal_mean3=peak, gain_peak=0.6, gain_confirmed=peak - 0.3,
                                 gain_terminal=peak - 0.3, gain_terminal3=peak - 0.3, se=0.03, cliff=False,
                                 collapse=False, stagnation=False, n_evals=3))  # fmt: skip
    summary = pd.DataFrame(recs)
    lines = findings.sp_ip_lines(contrasts(summary), summary)
    assert len(lines) == findings.SHOWN_CELLS + 1 and lines[-1].startswith("6 more cells")
    assert lines[0].startswith("orch_workers smol code: held-out peak -0.250") and all(
        " smol " in x for x in lines[:6]
    )


def colour_share(png: bytes) -> float:
    """Share of a PNG's pixels in a saturated colour (data: lines, bands, areas); 0 for a text-only
    placeholder or empty axes, which are black and grey on white."""
    import io

    from PIL import Image

    img = np.asarray(Image.open(io.BytesIO(png)).convert("RGB"), dtype=int)
    return float(((img.max(axis=2) - img.min(axis=2)) > 60).mean())


@pytest.mark.slow
def test_no_blank_figure(tmp_path, signal_runs):
    from marlflow.analysis.plots import _placeholder, png_bytes

    assert colour_share(png_bytes(_placeholder("no runs with an intervention"))) == 0.0  # the check can fail
    written = build(tmp_path, signal_runs)
    page = written["report.html"].read_text()
    figures = re.findall(r'<img alt="([^"]+)" src="data:image/png;base64,([A-Za-z0-9+/=]+)"', page)
    assert [alt for alt, _ in figures] == ["curves.png", "solution_metrics.png", "grad_dynamics.png",
                                           "role_share.png"]  # fmt: skip
    for alt, data in figures:
        assert colour_share(base64.b64decode(data)) > 0.002, f"{alt} is blank"
    for name, path in written.items():
        if name.endswith(".png"):
            assert colour_share(path.read_bytes()) > 0.002, f"{name} is blank"


def test_figure_scales(signal_runs):
    """grad_dynamics: one log y axis for all panels, zero-gradient steps left out (not drawn near 0);
    role_share: a step without a role's share is a hatched 'no data' band; solution metrics: <= 4 lines a panel."""
    from marlflow.analysis import load_runs
    from marlflow.analysis.plots import (
        MAX_LINES,
        NO_DATA_LABEL,
        plot_grad_norm,
        plot_role_share,
        plot_solution_metrics,
    )

    metrics, _ = load_runs(signal_runs)
    axes = plot_grad_norm(metrics).axes
    assert {ax.get_yscale() for ax in axes} == {"log"} and len({ax.get_ylim() for ax in axes}) == 1
    assert axes[0].get_ylim()[0] > 0.5  # not stretched down to a zero step plotted at a tiny value
    ip = next(ax for ax in axes if ax.get_title() == "voting-ip-toy-math-s0")
    for line in ip.lines:
        x, y = np.asarray(line.get_xdata(), float), np.asarray(line.get_ydata(), float)
        assert np.isnan(y[np.isin(x, [3, 4])]).all() and (y[~np.isin(x, [3, 4])] > 0).all()
    assert any("2 zero-gradient role-steps" in t.get_text() or "4 zero-gradient role-steps" in t.get_text()
               for t in ip.texts)  # fmt: skip
    fig = plot_role_share(metrics)
    ip = next(ax for ax in fig.axes if ax.get_title() == "voting-ip-toy-math-s0")
    hatched = [c for c in ip.collections if c.get_hatch() == "///"]
    assert len(hatched) == 1 and hatched[0].get_paths()[0].vertices[:, 1].max() > 0.5  # the generator's 0.75
    assert NO_DATA_LABEL in [t.get_text() for t in fig.legends[0].get_texts()]
    assert all(ax.get_ylim() == (0.0, 1.0) for ax in fig.axes)
    fig = plot_solution_metrics(metrics, ["careless_share"])
    assert [ax.get_title() for ax in fig.axes] == ["voting / math", "orch_workers / math"]
    assert fig.axes[0].get_ylabel() == "careless_share"
    assert all(0 < len(ax.lines) <= MAX_LINES for ax in fig.axes)


# ---------------------------------------------------------------------------- headless Chromium

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
WIDTH, HEIGHT = 1280, 1600
# Appended to a test-only copy: open every <details> (folded transcripts count too), then record the page
# width and, for every table, its laid-out width and scroll width, and any page-level horizontal overflow.
CHECK_JS = """<script>
for (const d of document.querySelectorAll('details')) d.open = true;
const W = document.documentElement.clientWidth;
const tables = [...document.querySelectorAll('table')].map(t => ({
  w: Math.ceil(t.getBoundingClientRect().width), sw: t.scrollWidth,
  right: Math.ceil(t.getBoundingClientRect().right), box: t.parentElement.clientWidth}));
document.body.setAttribute('data-check', JSON.stringify({W, page: document.documentElement.scrollWidth,
  tables, imgs: [...document.images].filter(i => i.complete && i.naturalWidth > 0).length,
  nimg: document.images.length}));
</script>"""


def chromium() -> str:
    for name in CHROMIUM_NAMES:
        path = shutil.which(name)
        if path:
            return path
    if os.environ.get("CI"):
        pytest.fail("headless Chromium is missing; CI installs it with `apt-get install -y chromium`")
    pytest.skip("headless Chromium not installed (apt-get install -y chromium)")


def run_chromium(exe: str, args: list[str], tmp: Path, height: int = HEIGHT) -> subprocess.CompletedProcess:
    cmd = [exe, "--headless=new", "--disable-gpu", "--no-sandbox", "--hide-scrollbars", "--no-first-run",
           f"--user-data-dir={tmp / 'chromium-profile'}", f"--window-size={WIDTH},{height}",
           "--virtual-time-budget=3000", *args]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, f"chromium failed ({r.returncode}): {r.stderr[-2000:]}"
    return r


def layout(exe: str, html_file: Path, tmp: Path) -> dict:
    probe = html_file.with_name(f".probe-{html_file.name}")  # beside the original: relative links still hold
    probe.write_text(html_file.read_text().replace("</body>", CHECK_JS + "</body>"))
    dom = run_chromium(exe, ["--dump-dom", probe.as_uri()], tmp).stdout
    probe.unlink()
    m = re.search(r"data-check=\"([^\"]+)\"", dom)
    assert m, f"the check script did not run; DOM starts {dom[:300]!r}"
    return json.loads(html.unescape(m.group(1)))


def screenshot_variance(exe: str, html_file: Path, shots: Path, tmp: Path) -> float:
    from PIL import Image

    shot = shots / f"{html_file.stem}.png"
    run_chromium(exe, [f"--screenshot={shot}", html_file.as_uri()], tmp)
    img = np.asarray(Image.open(shot).convert("L"), dtype=float)
    assert img.shape == (HEIGHT, WIDTH)
    return float(img.std())


@pytest.mark.slow
@pytest.mark.parametrize("source", ["synthetic", "toy_runs"])
def test_pages_in_headless_chromium(tmp_path, source, request):
    exe = chromium()
    written = build(tmp_path, request.getfixturevalue("runs" if source == "synthetic" else source))
    shots = Path(os.environ.get("MARLFLOW_REPORT_SHOTS", tmp_path / "shots")) / source
    shots.mkdir(parents=True, exist_ok=True)
    for key in ("report.html", "pages/voting-ip-toy-math-s0.html"):
        html_file = written[key]
        check = layout(exe, html_file, tmp_path)
        assert check["W"] == WIDTH and check["tables"], check
        assert check["nimg"] >= 1 and check["imgs"] == check["nimg"], (
            f"{key}: an embedded figure did not load"
        )
        assert check["page"] <= check["W"], (
            f"{key}: the page scrolls sideways ({check['page']} > {check['W']})"
        )
        for t in check["tables"]:
            # no table wider than the page, nor than its box (so no table needs its scroll container here)
            assert t["sw"] <= t["box"] <= check["W"] and t["right"] <= check["W"], (key, t, check["W"])
        variance = screenshot_variance(exe, html_file, shots, tmp_path)
        assert variance > 20, f"{key}: the screenshot is nearly uniform (pixel std {variance:.1f})"


FIRST_SCREEN = 800  # a 1280 x 800 window: what a reader sees before scrolling


def report_shipped_toy() -> Path:
    from marlflow.models.loading import SHIPPED_TOY

    return SHIPPED_TOY


def findings_rows(exe: str, html_file: Path, shot: Path, tmp: Path) -> np.ndarray:
    """Screenshot the page's first screen; the pixel rows at least 30% filled with the findings box's
    background colour (report_html.FINDINGS_BG, used by nothing else on the page)."""
    from PIL import Image

    run_chromium(exe, [f"--screenshot={shot}", html_file.as_uri()], tmp, height=FIRST_SCREEN)
    img = np.asarray(Image.open(shot).convert("RGB"), dtype=int)
    assert img.shape == (FIRST_SCREEN, WIDTH, 3)
    bg = np.array([int(report_html.FINDINGS_BG[i : i + 2], 16) for i in (1, 3, 5)])
    return np.flatnonzero((np.abs(img - bg).max(axis=2) <= 2).mean(axis=1) >= 0.3)


def toy_matrix(root: Path) -> list[str]:
    """The toy matrix's 14 runs (the cells of toy and of the default toy2: single SP; Eval-Opt, Voting,
    Orch-Workers x SP / IP; math, code)
    with everything the findings box lists at its longest: cliffs, format-failure rises in several runs,
    bases below the band, an SP - IP difference in every cell."""
    roles = {"single": ["generator"], "eval_opt": ["generator", "evaluator"], "voting": ["generator", "aggregator"],
             "orch_workers": ["orchestrator", "worker", "synthesizer"]}  # fmt: skip
    paths = []
    cells = [
        (w, sh, t)
        for w in roles
        for sh in (("sp",) if w == "single" else ("sp", "ip"))
        for t in ("math", "code")
    ]
    for i, (wf, sh, task) in enumerate(cells):
        base = 0.07 if wf == "orch_workers" and task == "math" else 0.3
        peak = min(0.95, base + 0.3 + 0.04 * i)
        acc = [base, peak, peak - (0.2 if i % 5 == 0 else 0.0)]
        sup = roles[wf][-1]
        ff = {sup: [0.09, 0.4, 0.795]} if wf in ("voting", "eval_opt") else None
        shares = {r: 1.0 / len(roles[wf]) for r in roles[wf]}
        paths.append(make_run(root, f"{wf}-{sh}-toy-{task}-s0", acc, shares, careless=[0.7, 0.3, 0.1],
                              format_failure=ff))  # fmt: skip
    return paths


@pytest.mark.slow
def test_findings_in_first_screen(tmp_path):
    """At 1280 x 800 the findings box of a full toy matrix (14 runs, every finding at its longest) starts near
    the top and ends on the first screen; the same check on a copy with the box moved below the provenance
    table fails (so it can)."""
    exe = chromium()
    runs = toy_matrix(tmp_path)
    for path in runs:  # the toy model rows of provenance carry a 64-character hash: they must wrap
        cfg = json.loads(Path(path).with_name("config.json").read_text())
        Path(path).with_name("config.json").write_text(
            json.dumps({**cfg, "model": str(report_shipped_toy())})
        )
    html_file = build(tmp_path, runs)["report.html"]
    box = findings_box(html_file.read_text())
    assert (
        box.count("&#x27;s format-failure rate rises") == 3
        and "more roles whose format-failure rate rises" in box
    )
    assert (
        box.count(" toy math: held-out peak ") + box.count(" toy code: held-out peak ") == 6
        and "toy bases are outside" in box
    )
    check = layout(exe, html_file, tmp_path)
    assert "weights_sha256" in html_file.read_text() and check["page"] <= check["W"], check
    assert all(t["sw"] <= t["box"] for t in check["tables"]), check  # no table wider than its box
    shots = Path(os.environ.get("MARLFLOW_REPORT_SHOTS", tmp_path / "shots")) / "first_screen"
    shots.mkdir(parents=True, exist_ok=True)
    rows = findings_rows(exe, html_file, shots / "report.png", tmp_path)
    assert len(rows) >= 150, f"the findings box fills {len(rows)} rows of the first screen"
    assert rows[0] < 200 and rows[-1] < FIRST_SCREEN - 5, (rows[0], rows[-1])  # starts high, ends on screen
    page = html_file.read_text()
    box = page[page.index("<section id='findings'") : page.index("</section>") + len("</section>")]
    moved = html_file.with_name("moved.html")
    moved.write_text(page.replace(box, "").replace("<h2 id='runs'>", box + "<h2 id='runs'>"))
    rows = findings_rows(exe, moved, shots / "moved.png", tmp_path)
    assert not (len(rows) >= 150 and rows[0] < 200), "the check does not see a box moved below provenance"

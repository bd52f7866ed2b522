"""Tests for marlflow.report: figures, the self-contained HTML page, errors."""

from __future__ import annotations

import base64
import re

import pandas as pd
import pytest

from marlflow import aggregate, report
from marlflow.metrics import rows, write_metrics

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def make_run(root, run_id: str, acc: list[float], roles: dict[str, float]) -> str:
    workflow, sharing, scale, task, seed = run_id.split("-")
    fac = dict(run_id=run_id, workflow=workflow, sharing=sharing, scale=scale, task=task, seed=int(seed[1:]),
               intervention="none")  # fmt: skip
    recs = []
    for k, a in enumerate(acc):
        recs += rows(fac, 10 * k, "eval", "all", {"accuracy": a, "n_eval": 50})
    for step in range(1, 10 * (len(acc) - 1) + 1):
        for role, share in roles.items():
            recs += rows(fac, step, "train", role, {"grad_norm": 1.0 + step * share, "grad_share": share})
    p = root / "runs" / run_id / "metrics.parquet"
    write_metrics(pd.DataFrame(recs), p)
    return str(p)


@pytest.fixture
def runs(tmp_path) -> list[str]:
    return [
        make_run(tmp_path, "voting-ip-toy-math-s0", [0.3, 0.6, 0.4], {"generator": 0.75, "aggregator": 0.25}),
        make_run(tmp_path, "voting-sp-toy-math-s0", [0.3, 0.4, 0.45], {"generator": 0.6, "aggregator": 0.4}),
        make_run(tmp_path, "single-sp-toy-math-s0", [0.3, 0.35, 0.35], {"generator": 1.0}),
    ]


def test_report_end_to_end(tmp_path, runs, capsys):
    tables = tmp_path / "tables"
    assert aggregate.main(["--runs", *runs, "--out", str(tables)]) == 0
    html_path = tmp_path / "report.html"
    figs = tmp_path / "figures"
    argv = ["--tables", str(tables), "--runs", *runs, "--figures", str(figs), "--html", str(html_path)]
    assert report.main(argv) == 0
    for name in ("curves.png", "grad_dynamics.png", "role_share.png"):
        assert (figs / name).read_bytes().startswith(PNG_MAGIC), name
    page = html_path.read_text()
    embedded = re.findall(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', page)
    assert len(embedded) == 3
    assert all(base64.b64decode(e).startswith(PNG_MAGIC) for e in embedded)
    assert base64.b64decode(embedded[0]) == (figs / "curves.png").read_bytes()
    for text in ("Failure signatures", "Gradient dynamics", "Definitions", "voting-ip-toy-math-s0", "cliff:"):
        assert text in page, text
    assert "http" not in page.replace("<!DOCTYPE html>", "")  # self-contained: no external resources
    # deterministic: a second report is byte-identical
    html2 = tmp_path / "report2.html"
    report.main(
        ["--tables", str(tables), "--runs", *runs, "--figures", str(tmp_path / "f2"), "--html", str(html2)]
    )
    assert html2.read_bytes() == html_path.read_bytes()


def test_curve_panels(runs):
    from marlflow.analysis import load_runs
    from marlflow.analysis.plots import plot_curves, plot_grad_norm, plot_role_share

    metrics, _ = load_runs(runs)
    assert [ax.get_title() for ax in plot_curves(metrics).axes] == ["single / math", "voting / math"]
    curves = plot_curves(metrics).axes[1]
    assert len(curves.lines) == 4  # two runs, each a curve + a dashed base line
    assert len(plot_grad_norm(metrics).axes) == 3 and len(plot_role_share(metrics).axes) == 3


def test_report_needs_tables(tmp_path, runs, capsys):
    argv = ["--tables", str(tmp_path / "none"), "--runs", *runs, "--figures", str(tmp_path / "f"),
            "--html", str(tmp_path / "r.html")]  # fmt: skip
    with pytest.raises(SystemExit) as exc:
        report.main(argv)
    assert exc.value.code == 2 and "run `python -m marlflow.aggregate` first" in capsys.readouterr().err
    assert not (tmp_path / "r.html").exists()


def test_report_needs_runs(tmp_path, runs, capsys):
    aggregate.main(["--runs", *runs, "--out", str(tmp_path / "t")])
    with pytest.raises(SystemExit):
        report.main(
            ["--tables", str(tmp_path / "t"), "--figures", str(tmp_path / "f"), "--html", str(tmp_path / "r")]
        )
    assert "no runs given" in capsys.readouterr().err

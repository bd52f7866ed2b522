"""benchmarks/harness.py, the set-up every A/B benchmark shares: interleaving order, medians and ratios, --quick,
the environment line and the toy cells a step benchmark selects. The benchmarks themselves are checked by running
them with --quick (benchmarks/RESULTS.md's intro); this keeps the shared part honest in CI."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def harness():
    spec = importlib.util.spec_from_file_location("harness", ROOT / "benchmarks" / "harness.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_interleaved_alternates_the_order_and_keeps_every_time(harness):
    calls = []
    variants = {n: (lambda n=n: calls.append(n) or n.upper()) for n in ("a", "b", "c")}
    times, last = harness.interleaved(variants, 4)
    assert calls == list("abccbaabccba")  # drift and warm caches favour no variant
    assert {n: len(t) for n, t in times.items()} == {"a": 4, "b": 4, "c": 4}
    assert last == {"a": "A", "b": "B", "c": "C"}


def test_report_gives_medians_and_ratios_to_the_base(harness):
    times = {"base": [1.0, 3.0, 2.0], "fast": [0.5, 0.4, 9.0]}
    assert harness.medians(times) == {"base": 2.0, "fast": 0.5}
    assert harness.report(times, base="base") == "base 2.000 s, fast 0.500 s (x0.25)"


def test_quick_means_one_round_and_the_environment_line_names_what_numbers_depend_on(harness, capsys, tmp_path,
                                                                                   monkeypatch):  # fmt: skip
    import torch

    monkeypatch.chdir(tmp_path)
    (tmp_path / "results/models/toy").mkdir(parents=True)  # the default, as `make run` leaves it
    threads = torch.get_num_threads()
    try:
        args = harness.setup(harness.parser("doc", reps=7).parse_args(["--quick"]))
    finally:
        torch.set_num_threads(threads)
    assert args.reps == 1 and args.model == "results/models/toy"
    line = capsys.readouterr().out
    assert "kernels" in line and "torch " in line and "1 thread(s)" in line
    assert f"commit {harness.commit().split('+')[0]}" in line and harness.commit() != "unknown"


def test_a_checkout_before_make_run_benchmarks_the_shipped_toy_and_a_wrong_model_path_says_so(
    harness, tmp_path, monkeypatch, capsys
):
    from marlflow.models.loading import SHIPPED_TOY

    monkeypatch.chdir(tmp_path)  # no results/models/toy here
    assert harness._model_folder("results/models/toy") == str(SHIPPED_TOY)
    assert "using the shipped toy model" in capsys.readouterr().out
    assert harness._model_folder("Qwen/Qwen3-0.6B") == "Qwen/Qwen3-0.6B"  # a hub id is left to the loader
    with pytest.raises(SystemExit, match="results/models/tiny: no such folder"):
        harness._model_folder("results/models/tiny")


def test_toy_cells_pick_one_run_per_workflow(harness):
    ap = harness.add_cells(harness.parser("doc"))
    args = ap.parse_args(["--sharing", "ip", "--task", "code", "--workflows", "single", "voting"])
    cells = harness.toy_cells(args)
    assert list(cells) == ["single-sp-toy-code-s0", "voting-ip-toy-code-s0"]  # single has SP only
    assert all(c.model == "results/models/toy" for c in cells.values())
    args.quick = True
    assert list(harness.toy_cells(args)) == ["single-sp-toy-code-s0"]

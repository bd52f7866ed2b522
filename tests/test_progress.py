"""A train job's log shows one line per step: step k/N, reward, live share, seconds per step, ETA, last eval."""

from __future__ import annotations

import logging
import re


def test_one_progress_line_per_step(make_cfg, tmp_path, caplog):
    from marlflow.cli.train import run

    cfg = make_cfg("single", "sp", steps=3, eval_every=2, save_every=0)
    with caplog.at_level(logging.INFO, logger="marlflow.training.trainer"):
        run(cfg, tmp_path / "run")
    lines = [
        r.getMessage()
        for r in caplog.records
        if r.getMessage().startswith("step ") and "ETA" in r.getMessage()
    ]
    pattern = r"step (\d)/3  reward [\d.]+  live \d+%  [\d.]+ s/step  ETA \d\d:\d\d:\d\d  last eval accuracy ([\d.]+)"
    assert [re.fullmatch(pattern, ln).group(1) for ln in lines] == ["1", "2", "3"], lines
    assert lines[-1].endswith("ETA 00:00:00  last eval accuracy " + re.fullmatch(pattern, lines[-1]).group(2))

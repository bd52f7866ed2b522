"""Time-based checkpoints (RunConfig.save_every_minutes): with hour-long steps, save_every steps could span a
whole job; a checkpoint then follows any step that would leave more than the set time unsaved. They change
nothing the run computes: the run with them ends bit-identical to the run without, and its config's
fingerprint (what a checkpoint must match to be resumed from) is the same."""

from __future__ import annotations

import dataclasses

import pandas as pd
import pytest

from marlflow.cli.train import run
from marlflow.core.config import config_fingerprint
from marlflow.store.schema import VOLATILE_METRICS


def _metrics(folder):
    m = pd.read_parquet(folder / "metrics.parquet")
    return m[~m.metric.isin(VOLATILE_METRICS)].reset_index(drop=True)


@pytest.mark.slow
def test_time_based_checkpoints_keep_pace_and_change_nothing(make_cfg, tmp_path):
    plain = make_cfg("single", "sp", steps=3, save_every=0)
    timed = dataclasses.replace(plain, save_every_minutes=1e-9)  # every step is "too long unsaved"
    assert config_fingerprint(plain.to_dict()) == config_fingerprint(timed.to_dict())
    assert "save_every_minutes" not in plain.to_dict()  # off: existing configs unchanged
    run(plain, tmp_path / "plain")
    run(timed, tmp_path / "timed")
    steps = lambda d: sorted(p.name for p in (d / "checkpoints").glob("step-*"))  # noqa: E731
    assert steps(tmp_path / "plain") == ["step-3"]
    assert steps(tmp_path / "timed") == ["step-1", "step-2", "step-3"]
    pd.testing.assert_frame_equal(_metrics(tmp_path / "plain"), _metrics(tmp_path / "timed"))
    for name in ("samples.parquet", "outcomes.parquet"):
        pd.testing.assert_frame_equal(
            pd.read_parquet(tmp_path / "plain" / name), pd.read_parquet(tmp_path / "timed" / name)
        )

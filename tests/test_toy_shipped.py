"""The toy model shipped in src/marlflow/models/toy_model/: its weights hash to its warmstart.json (CI runs this),
`prepare --scale toy` copies it and writes READY, a corrupted or stale copy fails with the hashes and the
fix, and a model rebuilt here (a short build) loads and generates like the shipped one."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from marlflow.cli import models as models_cli
from marlflow.models import loading as models
from marlflow.models import toybuild

SHORT = {"steps": 3, "batch_size": 8, "solve_steps": 0, "eval_n": 0}


def test_shipped_weights_match_their_warmstart_json():
    info = models.check_shipped_toy()  # raises on a hash mismatch or stale sources
    assert models.folder_weights_sha256(models.SHIPPED_TOY) == info["weights_sha256"]
    assert info["version"] == toybuild.toy_version()
    # The build's provenance, as docs/results.md quotes it.
    assert info["seed"] == 0 and info["threads"] == toybuild.THREADS and info["torch"] and info["cpu_model"]
    assert (info["steps"], info["solve_steps"], info["batch_size"], info["lr"]) == (
        toybuild.STEPS, toybuild.SOLVE_STEPS, toybuild.BATCH_SIZE, toybuild.LR)  # fmt: skip
    assert not (models.SHIPPED_TOY / "READY").exists()  # READY belongs to a prepared folder, not the source


def test_prepare_copies_the_shipped_model_and_writes_ready(tmp_path):
    out = tmp_path / "toy"
    models_cli.main(
        ["prepare", "--scale", "toy", "--model", "toy", "--out", str(out)]
    )  # the models rule's command
    ready = json.loads((out / "READY").read_text())
    info = json.loads((models.SHIPPED_TOY / "warmstart.json").read_text())
    assert ready["source"] == "shipped" and ready["weights_sha256"] == info["weights_sha256"]
    assert ready["toy_version"] == toybuild.toy_version() and ready["model"] == str(out.resolve())
    shipped = sorted(f.name for f in models.SHIPPED_TOY.iterdir())
    assert {"model.safetensors", "tokenizer.json", "config.json", "warmstart.json"} <= set(shipped)
    assert sorted(f.name for f in out.iterdir()) == sorted([*shipped, "READY"])
    for f in shipped:
        assert (out / f).read_bytes() == (models.SHIPPED_TOY / f).read_bytes(), f
    stamp = (out / "READY").stat().st_mtime_ns
    assert models.prepare("toy", "toy", out) == ready
    assert (out / "READY").stat().st_mtime_ns == stamp  # prepared already: nothing is redone


def _flip_one_byte(path):
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x01  # inside the last tensor's bytes (the header is at the start)
    path.write_bytes(bytes(data))


def test_corrupted_shipped_model_fails_naming_both_hashes(tmp_path):
    source = tmp_path / "shipped"
    shutil.copytree(models.SHIPPED_TOY, source)
    _flip_one_byte(source / "model.safetensors")
    recorded = json.loads((source / "warmstart.json").read_text())["weights_sha256"]
    actual = models.folder_weights_sha256(source)
    assert actual != recorded
    with pytest.raises(RuntimeError, match="do not match its warmstart.json") as err:
        models.prepare("toy", "toy", tmp_path / "out", shipped=source)
    assert (
        recorded in str(err.value)
        and actual in str(err.value)
        and "marlflow.models.toybuild --out" in str(err.value)
    )
    assert not (tmp_path / "out" / "READY").exists()


def test_stale_shipped_model_says_how_to_rebuild(tmp_path):
    source = tmp_path / "shipped"
    shutil.copytree(models.SHIPPED_TOY, source)
    info = json.loads((source / "warmstart.json").read_text())
    (source / "warmstart.json").write_text(json.dumps(info | {"version": "0000000000000000"}))
    with pytest.raises(RuntimeError, match="is stale") as err:
        models.prepare("toy", "toy", tmp_path / "out", shipped=source)
    assert "python -m marlflow.models.toybuild --out src/marlflow/models/toy_model" in str(err.value)
    assert "--build" in str(err.value)


def _chat_ids(tok):
    messages = [{"role": "user", "content": "Compute 12-3*4. Put the answer in \\boxed{}."}]
    return tok.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )


@pytest.mark.slow
def test_rebuilt_and_shipped_models_load_alike(tmp_path):
    """A rebuild (here a short one) goes through the same loader as the shipped model: same tokenizer kind,
    special tokens and chat template, same architecture; both generate. `build=True` builds even when the
    settings are the shipped model's (shown with a copy of the shipped folder that records SHORT's settings)."""
    source = tmp_path / "shipped"
    shutil.copytree(models.SHIPPED_TOY, source)
    info = json.loads((source / "warmstart.json").read_text())
    (source / "warmstart.json").write_text(json.dumps(info | {k: SHORT[k] for k in ("steps", "batch_size",
                                                                                     "solve_steps")}))  # fmt: skip
    shipped_ready = models.prepare("toy", "toy", tmp_path / "copied", shipped=source, **SHORT)
    assert shipped_ready["source"] == "shipped"
    built = tmp_path / "built"
    ready = models.prepare("toy", "toy", built, shipped=source, build=True, **SHORT)
    assert ready["source"] == "built" and "weights_sha256" not in ready
    built_info = json.loads((built / "warmstart.json").read_text())
    assert models.folder_weights_sha256(built) == built_info["weights_sha256"]  # file hash == build's hash
    assert built_info["weights_sha256"] != info["weights_sha256"]

    loaded = {name: models.load_model_and_tokenizer(str(path)) for name, path in
              (("shipped", models.SHIPPED_TOY), ("built", built))}  # fmt: skip
    (ms, ts), (mb, tb) = loaded["shipped"], loaded["built"]
    assert type(ms) is type(mb) and type(ts) is type(tb)
    assert ts.chat_template == tb.chat_template == toybuild.CHAT_TEMPLATE
    for attr in ("pad_token", "eos_token", "pad_token_id", "eos_token_id", "padding_side"):
        assert getattr(ts, attr) == getattr(tb, attr), attr
    assert ts.tokenize("1234") == tb.tokenize("1234") == ["1", "2", "3", "4"]  # digits stay single tokens
    # The vocabulary is trained on the build's corpus, so its size follows the build's steps; the rest not.
    cs, cb = ms.config.to_dict(), mb.config.to_dict()
    assert cs["vocab_size"] == len(ts) and cb["vocab_size"] == len(tb)
    drop = {"vocab_size", "transformers_version", "_name_or_path"}
    assert {k: v for k, v in cs.items() if k not in drop} == {k: v for k, v in cb.items() if k not in drop}
    for model, tok in loaded.values():
        batch = _chat_ids(tok)
        with torch.no_grad():
            out = model.generate(**batch, max_new_tokens=6, do_sample=False)
        assert (
            out.shape[0] == 1
            and batch["input_ids"].shape[1] < out.shape[1] <= batch["input_ids"].shape[1] + 6
        )

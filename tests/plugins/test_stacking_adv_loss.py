"""Stacking: each loss-stage plugin of issue 5 (disco, hicra) runs end to end together with an advantage plugin.

* disco + dagrpo: DaGRPO's anchors (sampling) give every all-fail group a positive, DisCO turns the groups into
  sequence weights (advantage), DaGRPO masks low-distinctiveness pairs of those weights (advantage, chained after
  disco), and DisCO's unclipped score loss replaces the surrogate while the anchors take the shaped off-policy branch.
* riskpo + hicra: RiskPO's MVaR advantages (advantage) are amplified on planning tokens by HICRA (loss).
"""

import pytest
import torch

from trl_plugins.testing import digit_fraction_reward, make_tiny_trainer, record_run
from trl_plugins_builtin.riskpo import riskpo_advantages


def test_disco_with_dagrpo_anchors_and_pair_masking(tmp_path):
    trainer = make_tiny_trainer(plugins=["disco", "dagrpo"], plugin_config={"dagrpo": {"scorer": "prm"}},
                                loss_type="grpo", max_steps=2, output_dir=str(tmp_path))
    G = trainer.num_generations
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    run = record_run(trainer)
    for rewards, advantages in zip(run.rewards, run.advantages):
        # untrained model: every group fails, slot 0 becomes the (correct) reference solution
        assert rewards[:, 0].view(-1, G)[:, 0].eq(1).all() and rewards[:, 0].view(-1, G)[:, 1:].eq(0).all()
        a = advantages.view(-1, G)
        # DisCO weights: anchor G/|P| = G, failures -G softmax (sum -G). DaGRPO (PRM scores: anchor 1, failures 0):
        # failure pairs are masked, so anchor: G - mean(failures) = G + G/(G-1); failure j: w_j - G.
        torch.testing.assert_close(a[:, 0], torch.full_like(a[:, 0], G + G / (G - 1)))
        torch.testing.assert_close(a[:, 1:].sum(1), torch.full_like(a[:, 0], -G - (G - 1) * G))
        assert torch.all(a[:, 1:] < -G)
    assert any(not torch.equal(before[n], p) for n, p in run.params.items())
    logs = [log for log in run.logs if "loss" in log]
    assert len(logs) == 2
    for log in logs:
        assert log["plugins/dagrpo/anchored_group_fraction"] == 1.0
        assert log["plugins/disco/mixed_group_fraction"] == 1.0
        assert log["plugins/framework/offpolicy_token_fraction"] > 0
        assert "plugins/disco/kl" in log and "plugins/dagrpo/masked_pair_fraction" in log


PHRASES = {"phrases": ["1", "2", "3", "="], "whole_words": False}


def test_hicra_amplifies_riskpo_advantages(tmp_path):
    common = dict(reward_funcs=[digit_fraction_reward], num_generations=2, max_steps=1, output_dir=str(tmp_path))
    options = {"bundle_size": 2}
    alone = record_run(make_tiny_trainer(plugins=["riskpo"], plugin_config={"riskpo": options}, **common))
    trainer = make_tiny_trainer(plugins=["riskpo", "hicra"],
                                plugin_config={"riskpo": options, "hicra": {"alpha": 0.5, **PHRASES}}, **common)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    run = record_run(trainer)
    expected, _ = riskpo_advantages(run.rewards[0].sum(1), 2, 2, 0.2, 0.8, 1.5, "averse", "sum_mean", False, True,
                                    1e-6)
    assert expected.abs().max() > 0
    torch.testing.assert_close(run.advantages[0], expected)  # the sequence advantages are RiskPO's ...
    assert torch.equal(run.advantages[0], alone.advantages[0])
    assert any(not torch.equal(run.grads[0][k], alone.grads[0][k]) for k in alone.grads[0])  # ... HICRA reshapes them
    assert any(not torch.equal(before[n], p) for n, p in run.params.items())
    (log,) = [log for log in run.logs if "loss" in log]
    assert log["plugins/hicra/planning_token_fraction"] > 0
    assert log["plugins/riskpo/abs_advantage"] == pytest.approx(expected.abs().mean().item())

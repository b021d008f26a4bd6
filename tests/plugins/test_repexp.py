"""RepExp: the sparse projection's entries and determinism (sklearn's density 'auto' too, redrawn every step); the
official leverage score (whole group, no square root) against an explicit rank-one-update computation; the bonus is 0
in a group with no correct response; the leave-one-out elliptical bonus equals the explicit formula, is larger for a response unlike the rest of its group than for duplicated ones, and shrinks as lambda
grows; the reward hook fills the column from the context's features (correct rows only when asked); beta = 0 skips
the forward and equals vanilla TRL apart from the all-zero column; a run on the tiny model uses the trainer's
backbone forward and trains; bad options refused."""

import math

import pytest
import torch
from trl import GRPOTrainer

from trl_plugins import PluginConfigError, build_plugins
from trl_plugins.testing import digit_fraction_reward, make_reward_context, make_tiny_trainer, record_run, run_hook
from trl_plugins_builtin.repexp import leave_one_out_bonus, leverage_bonus, sparse_projection


def test_sparse_projection_entries_and_seed():
    p = sparse_projection(300, 16, seed=3)
    scale = torch.tensor(math.sqrt(3 / 16))  # float32, as the matrix
    assert set(p.unique().tolist()) <= {0.0, float(scale), -float(scale)}
    assert 0.25 < float((p != 0).float().mean()) < 0.42  # about 1/3 non-zero
    assert torch.equal(p, sparse_projection(300, 16, seed=3))
    assert not torch.equal(p, sparse_projection(300, 16, seed=4))


def test_bonus_matches_the_explicit_formula():
    g = torch.Generator().manual_seed(0)
    feats = torch.randn(6, 4, generator=g)
    bonus = leave_one_out_bonus(feats, 3, ridge=0.5, center=True)
    z = feats.double().view(2, 3, 4)
    z = z - z.mean(1, keepdim=True)
    for gi in range(2):
        for i in range(3):
            others = [z[gi, j] for j in range(3) if j != i]
            cov = 0.5 * torch.eye(4, dtype=torch.float64) + sum(torch.outer(v, v) for v in others)
            expected = torch.sqrt(z[gi, i] @ torch.linalg.inv(cov) @ z[gi, i])
            assert float(bonus[gi * 3 + i]) == pytest.approx(float(expected), rel=1e-5)


def test_a_novel_response_earns_more_than_duplicates():
    feats = torch.tensor([[1.0, 0.0, 0.0], [1.0, 0.0, 0.0], [0.0, 1.0, 0.0]])
    bonus = leave_one_out_bonus(feats, 3, ridge=1.0, center=False)
    assert bonus[0] == pytest.approx(bonus[1])
    assert bonus[2] > bonus[0]
    # lambda large: the bonus tends to |z| / sqrt(lambda)
    big = leave_one_out_bonus(feats, 3, ridge=1e6, center=False)
    torch.testing.assert_close(big, torch.full((3,), 1e-3), rtol=1e-3, atol=0)


def test_auto_density_is_sklearns():
    d, k = 400, 32
    p = sparse_projection(d, k, seed=1, density="auto")  # s = sqrt(400) = 20: entries +-sqrt(20/32), 1/20 non-zero
    scale = float(torch.tensor(math.sqrt(20 / 32)))  # float32, as the matrix
    assert set(p.unique().tolist()) <= {0.0, scale, -scale}
    assert 0.03 < float((p != 0).float().mean()) < 0.07


def test_leverage_score_is_the_official_one():
    # official worker: centre the group, inverse built by Sherman-Morrison from I / lambda over every response of the
    # group, bonus z^T inv z (no square root)
    g = torch.Generator().manual_seed(0)
    feats = torch.randn(8, 3, generator=g)
    lam = 0.01
    bonus = leverage_bonus(feats, 4, ridge=lam)
    for gi in range(2):
        z = feats[4 * gi: 4 * gi + 4].double()
        z = z - z.mean(0)
        inv = torch.eye(3, dtype=torch.float64) / lam
        for v in z:
            v = v.unsqueeze(1)
            inv = inv - inv @ v @ v.T @ inv / (1 + v.T @ inv @ v)
        for i in range(4):
            assert float(bonus[4 * gi + i]) == pytest.approx(float(z[i] @ inv @ z[i]), rel=1e-6)
    assert float(bonus.max()) < 1.0  # a leverage score lies in [0, 1)


def _ctx(features, verdict=(1.0, 0.0, 1.0, 1.0)):
    calls = []

    def policy_features(prompt_ids, completion_ids):
        calls.append(len(completion_ids))
        return features

    rewards = [[v, 0.0] for v in verdict]
    ctx = make_reward_context(rewards, num_generations=2, reward_func_names=["acc", "repexp"],
                              completions=["a", "b", "c", "d"], policy_features=policy_features,
                              reference_features=policy_features)
    ctx.calls = calls
    return ctx


def test_hook_fills_the_column_from_features():
    g = torch.Generator().manual_seed(1)
    features = torch.randn(4, 8, generator=g)
    ctx = _ctx(features)
    run_hook("repexp", "trl_plugins_transform_rewards", ctx, {"repexp": {"beta": 0.5, "projection_dim": 0}})
    assert ctx.calls == [4]
    expected = 0.5 * leverage_bonus(features, 2, 0.01)
    torch.testing.assert_close(ctx.rewards_per_func[:, 1], expected)
    assert ctx.rewards_per_func[:, 0].tolist() == [1.0, 0.0, 1.0, 1.0]
    ctx = _ctx(features)
    run_hook("repexp", "trl_plugins_transform_rewards", ctx, {"repexp": {"beta": 0.5, "projection_dim": 0,
                                                                         "only_correct": True}})
    assert ctx.rewards_per_func[1, 1] == 0 and ctx.rewards_per_func[0, 1] == pytest.approx(float(expected[0]))
    ctx = _ctx(features)
    run_hook("repexp", "trl_plugins_transform_rewards", ctx, {"repexp": {"beta": 0.5, "projection_dim": 0,
                                                                         "bonus": "leave_one_out_sqrt", "ridge": 1.0}})
    torch.testing.assert_close(ctx.rewards_per_func[:, 1], 0.5 * leave_one_out_bonus(features, 2, 1.0))


def test_a_group_with_no_correct_response_gets_no_bonus():
    g = torch.Generator().manual_seed(2)
    features = torch.randn(4, 8, generator=g)
    ctx = _ctx(features, verdict=(0.0, 0.0, 1.0, 0.0))
    run_hook("repexp", "trl_plugins_transform_rewards", ctx, {"repexp": {"beta": 0.5, "projection_dim": 0}})
    expected = 0.5 * leverage_bonus(features, 2, 0.01)
    assert ctx.rewards_per_func[:2, 1].tolist() == [0.0, 0.0]
    torch.testing.assert_close(ctx.rewards_per_func[2:, 1], expected[2:])  # the wrong row of a mixed group is paid
    ctx = _ctx(features, verdict=(0.0, 0.0, 1.0, 0.0))
    run_hook("repexp", "trl_plugins_transform_rewards", ctx, {"repexp": {"beta": 0.5, "projection_dim": 0,
                                                                         "zero_if_none_correct": False}})
    torch.testing.assert_close(ctx.rewards_per_func[:, 1], expected)


def test_the_projection_is_redrawn_every_step():
    g = torch.Generator().manual_seed(3)
    features = torch.randn(4, 100, generator=g)
    seen = []
    for step, options in ((0, {}), (0, {}), (1, {}), (1, {"redraw_projection": False}),
                          (0, {"redraw_projection": False})):
        ctx = _ctx(features)
        ctx.step = step
        run_hook("repexp", "trl_plugins_transform_rewards", ctx, {"repexp": {"beta": 1.0, "projection_dim": 8,
                                                                             **options}})
        seen.append(ctx.rewards_per_func[:, 1].clone())
    assert torch.equal(seen[0], seen[1]) and not torch.equal(seen[0], seen[2])
    assert torch.equal(seen[3], seen[4])  # fixed matrix: the step does not matter


def test_features_come_from_the_reference_policy_by_default():
    # official: the elliptical reward model is a frozen copy of the base model
    calls = []
    ref = torch.randn(4, 8, generator=torch.Generator().manual_seed(4))
    policy = torch.randn(4, 8, generator=torch.Generator().manual_seed(5))
    for options, expected in (({}, ref), ({"features": "policy"}, policy)):
        ctx = make_reward_context([[1.0, 0.0]] * 4, num_generations=2, reward_func_names=["acc", "repexp"],
                                  completions=["a", "b", "c", "d"],
                                  policy_features=lambda p, c: calls.append("policy") or policy,
                                  reference_features=lambda p, c: calls.append("reference") or ref)
        run_hook("repexp", "trl_plugins_transform_rewards", ctx, {"repexp": {"projection_dim": 0, **options}})
        torch.testing.assert_close(ctx.rewards_per_func[:, 1], 0.01 * leverage_bonus(expected, 2, 0.01))
    assert calls == ["reference", "policy"]
    assert build_plugins(["repexp"]).plugins[0].needs_reference_model
    assert not build_plugins(["repexp"], {"repexp": {"features": "policy"}}).plugins[0].needs_reference_model
    assert not build_plugins(["repexp"], {"repexp": {"beta": 0.0}}).plugins[0].needs_reference_model


def test_zero_beta_skips_the_forward():
    ctx = _ctx(torch.zeros(4, 2))
    run_hook("repexp", "trl_plugins_transform_rewards", ctx, {"repexp": {"beta": 0.0}})
    assert ctx.calls == [] and ctx.rewards_per_func[:, 1].tolist() == [0.0] * 4


def test_bad_options_are_refused():
    with pytest.raises(PluginConfigError, match="ridge"):
        build_plugins(["repexp"], {"repexp": {"ridge": 0.0}})
    with pytest.raises(PluginConfigError, match="projection_dim"):
        build_plugins(["repexp"], {"repexp": {"projection_dim": -1}})


RUN = dict(max_steps=2, num_generations=4, per_device_train_batch_size=8)


def test_neutral_is_vanilla_and_a_run_uses_the_backbone_forward(tmp_path):
    vanilla = record_run(make_tiny_trainer(GRPOTrainer, reward_funcs=[digit_fraction_reward],
                                           output_dir=str(tmp_path / "v"), **RUN))
    neutral = record_run(make_tiny_trainer(reward_funcs=[digit_fraction_reward], plugins=["repexp"],
                                           plugin_config={"repexp": {"beta": 0.0}},
                                           output_dir=str(tmp_path / "n"), **RUN))
    for x, y in zip(vanilla.rewards, neutral.rewards):
        torch.testing.assert_close(x, y[:, :1], rtol=0, atol=0)
    for x, y in zip(vanilla.advantages, neutral.advantages):
        torch.testing.assert_close(x, y, rtol=0, atol=0)
    for key in vanilla.params:
        torch.testing.assert_close(vanilla.params[key], neutral.params[key], rtol=0, atol=0)
    trainer = make_tiny_trainer(reward_funcs=[digit_fraction_reward], plugins=["repexp"],
                                plugin_config={"repexp": {"projection_dim": 8, "zero_if_none_correct": False}},
                                output_dir=str(tmp_path / "a"), **RUN)
    features = trainer.policy_probe.features([[5, 6], [5]], [[7, 8, 9], [7]])
    assert features.shape == (2, trainer.model.config.hidden_size)
    assert trainer.reference_copy is not None  # features="reference" (default), full fine-tuning, beta = 0
    torch.testing.assert_close(trainer.policy_probe.features([[5, 6]], [[7, 8, 9]], reference=True), features[:1])
    acting = record_run(trainer)
    assert all(float(r[:, 1].min()) > 0 for r in acting.rewards)  # every response has some novelty
    logs = [log for log in acting.logs if "loss" in log]
    assert logs and all(log["plugins/repexp/bonus"] > 0 for log in logs)

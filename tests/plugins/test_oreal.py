"""oreal: OREAL (from the official code, without its token-level reward model).

Rewards and leave-one-out advantages by hand, the default of the official wo_tokenrm config (every row trained,
uniform groups at advantage 0), the pair filter of the with-token-RM configs (one correct + one wrong per mixed group,
uniform groups dropped), the official normalisation (positive / negative token sums each over their own count) checked as a
full dapo micro-batch loss, the behaviour-cloning gradient on positives and the unclipped ratio on negatives, the
verifier column deciding success, construction refusals, the neutral setting and a tiny-model run."""

import pytest
import torch

from trl_plugins import IncompatiblePluginsError
from trl_plugins.testing import (
    assert_reduces_to_vanilla,
    build_stack,
    digit_fraction_reward,
    loss_from_context,
    make_advantage_context,
    make_loss_context,
    make_tiny_trainer,
    record_run,
    run_hook,
)
from trl_plugins_builtin.oreal import (
    POSITIVE_KEY,
    SCALE_KEY,
    oreal_rewards,
    oreal_token_loss,
    pair_filter,
    rloo_advantages,
    row_scales,
)

SUCCESS = torch.tensor([True, False, False, False, True, True, True, True, False, True, False, True])  # G = 4


def test_rloo_on_plus_minus_one_rewards():
    r = oreal_rewards(SUCCESS[:4])
    assert r.tolist() == [1.0, -1.0, -1.0, -1.0]
    # correct: 1 - (-3/3) = 2; wrong: -1 - (1 - 2)/3 = -2/3
    assert torch.allclose(rloo_advantages(r, 4), torch.tensor([2.0, -2 / 3, -2 / 3, -2 / 3]))


def test_pair_filter_keeps_one_pair_of_each_mixed_group():
    keep = pair_filter(SUCCESS, 4, "one_pair", torch.Generator().manual_seed(0)).view(3, 4)
    s = SUCCESS.view(3, 4)
    assert keep[1].sum() == 0  # all correct: dropped
    for g in (0, 2):
        assert (keep[g] & s[g]).sum() == 1 and (keep[g] & ~s[g]).sum() == 1
    assert torch.equal(pair_filter(SUCCESS, 4, "all_mixed", torch.Generator()).view(3, 4)[:, 0],
                       torch.tensor([True, False, True]))
    assert pair_filter(SUCCESS, 4, "none", torch.Generator()).all()


def test_row_scales_reproduce_the_official_token_counts():
    positive = torch.tensor([True, False, True, False])
    keep = torch.tensor([True, True, True, False])
    lengths = torch.tensor([2.0, 3.0, 4.0, 5.0])  # 14 tokens; kept positives 6, kept negatives 3
    scales = row_scales(positive, keep, lengths, 1.0, 0.5, "official")
    assert torch.allclose(scales, torch.tensor([14 / 6, 14 / 3 * 0.5, 14 / 6, 0.0]))
    assert torch.allclose(row_scales(positive, keep, lengths, 1.0, 0.5, "run"), torch.tensor([1.0, 0.5, 1.0, 0.0]))


def test_dapo_micro_batch_loss_equals_the_official_formula():
    # rows: positive (2 tokens), negative (3), positive (4), dropped (5): as the official per-token sums
    mask = torch.tensor([[1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]).float()
    g = torch.Generator().manual_seed(0)
    lp = (-2 * torch.rand(4, 5, generator=g)).requires_grad_(True)
    old = lp.detach() + 0.2 * torch.randn(4, 5, generator=g)
    positive, keep = torch.tensor([True, False, True, False]), torch.tensor([True, True, True, False])
    adv = torch.tensor([1.0, -0.5, 2.0, 0.0])
    scale = row_scales(positive, keep, mask.sum(-1), 1.0, 0.5, "official")
    ctx = make_loss_context(lp, old_per_token_logps=old, advantages=adv, mask=mask, loss_type="dapo",
                            extras={POSITIVE_KEY: positive.float(), SCALE_KEY: scale})
    run_hook("oreal", "trl_plugins_loss", ctx, loss_type="dapo")
    loss = loss_from_context(ctx)
    ratio = torch.exp(lp - old)
    pos_sum = (-(adv[0] * lp[0]) * mask[0]).sum() + (-(adv[2] * lp[2]) * mask[2]).sum()
    neg_sum = (-(ratio[1] * adv[1]) * mask[1]).sum()
    official = pos_sum / 6 * 1.0 + neg_sum / 3 * 0.5
    assert torch.allclose(loss, official)


def test_positive_gradient_is_behaviour_cloning_and_negative_ratio_is_unclipped():
    lp = torch.tensor([[-1.0, -2.0], [-1.0, -2.0]]).requires_grad_(True)
    old = torch.tensor([[-1.0, -2.0], [-2.0, -2.0]])  # row 1 token 0: ratio e (far outside any clip)
    adv = torch.tensor([[0.5], [-1.0]])
    oreal_token_loss(lp, old, adv, torch.tensor([True, False]), torch.ones(2)).sum().backward()
    assert torch.allclose(lp.grad[0], torch.tensor([-0.5, -0.5]))  # -A d(log pi)
    assert torch.allclose(lp.grad[1], torch.tensor([torch.e, 1.0]))  # -A r, r = e and 1


def test_advantage_hook_uses_the_verifier_column_and_attaches_extras():
    # column 0 verifier (correct = 1), column 1 a format reward that must not count as success
    per_func = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 1.0], [0.0, 1.0]])
    ctx = make_advantage_context(per_func.sum(-1), rewards_per_func=per_func, num_generations=4,
                                 completion_lengths=[2, 3, 4, 5])
    run_hook("oreal", "trl_plugins_transform_advantages", ctx, loss_type="dapo")
    assert ctx.extras[POSITIVE_KEY].tolist() == [1.0, 0.0, 0.0, 0.0]
    # default filter 'none' (wo_tokenrm config): every row kept, scaled by its sign's token count (14 tokens: 2 / 12)
    assert torch.allclose(ctx.extras[SCALE_KEY], torch.tensor([14 / 2, 14 / 12 * 0.5, 14 / 12 * 0.5, 14 / 12 * 0.5]))
    assert torch.allclose(ctx.advantages, torch.tensor([2.0, -2 / 3, -2 / 3, -2 / 3]))  # RLOO of +1 among three -1
    assert ctx.metrics["plugins/oreal/mixed_group_fraction"] == [1.0]
    assert ctx.metrics["plugins/oreal/kept_fraction"] == [1.0]


def test_one_pair_filter_keeps_a_pair_and_zeroes_the_rest():
    per_func = torch.tensor([[1.0], [0.0], [0.0], [0.0]])
    ctx = make_advantage_context(per_func.sum(-1), rewards_per_func=per_func, num_generations=4,
                                 completion_lengths=[2, 3, 4, 5])
    run_hook("oreal", "trl_plugins_transform_advantages", ctx, options={"filter": "one_pair"}, loss_type="dapo")
    kept = ctx.extras[SCALE_KEY] > 0
    assert kept.sum() == 2 and bool(kept[0])
    assert ctx.advantages[0] == pytest.approx(2.0)
    assert (ctx.advantages[~kept] == 0).all()


def test_uniform_groups_train_nothing():
    # default (no filter): an all-correct group is kept but its leave-one-out advantage is 0, so its loss is 0
    ctx = make_advantage_context(torch.ones(4), num_generations=4)
    run_hook("oreal", "trl_plugins_transform_advantages", ctx, loss_type="dapo")
    assert (ctx.advantages == 0).all() and (ctx.extras[SCALE_KEY] > 0).all()
    ctx = make_advantage_context(torch.ones(4), num_generations=4)
    run_hook("oreal", "trl_plugins_transform_advantages", ctx, options={"filter": "one_pair"}, loss_type="dapo")
    assert (ctx.extras[SCALE_KEY] == 0).all() and (ctx.advantages == 0).all()


def test_official_normalisation_needs_dapo():
    with pytest.raises(IncompatiblePluginsError, match="loss_type='dapo'"):
        build_stack("oreal", loss_type="grpo")
    build_stack("oreal", {"oreal": {"normalisation": "run"}}, loss_type="grpo")


NEUTRAL = {"baseline": "trl", "positive_objective": "policy_gradient", "filter": "none", "normalisation": "run",
           "negative_loss_factor": 1.0}


def test_neutral_setting_is_vanilla():
    assert_reduces_to_vanilla("oreal", NEUTRAL, loss_types=("grpo", "dapo"), steps=1)


def test_tiny_run_changes_parameters():
    # a dense verifier (digit fraction) with a threshold gives mixed groups on the untrained model
    trainer = make_tiny_trainer(plugins=["oreal"], loss_type="dapo", max_steps=1, reward_funcs=[digit_fraction_reward],
                                plugin_config={"oreal": {"filter": "all_mixed", "success_threshold": 0.2}})
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    run = record_run(trainer)
    logs = {k: v for log in run.logs for k, v in log.items()}
    assert logs["plugins/oreal/mixed_group_fraction"] > 0
    assert any(not torch.equal(before[n], p) for n, p in trainer.model.named_parameters())

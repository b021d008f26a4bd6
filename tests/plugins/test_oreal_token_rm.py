"""oreal token_rm: OREAL's token-level reward model (official train_oreal.py).

The weight formula by hand (cumulative-mean sigmoid, threshold and top-k rescaling, padding left out), the loss with
the weights against the official per-token expression, the head's training step reducing its cross-entropy on a toy
problem (and never touching the policy's gradient), the frozen-actor warm-up, checkpoint/resume of the head and its
optimiser, and a tiny-model run."""

import math

import pytest
import torch

from trl_plugins import PluginConfigError
from trl_plugins.runtime.head_stats import HeadStats
from trl_plugins.runtime.checkpoints import load_plugin_state, save_plugin_state
from trl_plugins.testing import build_stack, loss_from_context, make_loss_context, make_tiny_trainer, record_run
from trl_plugins_builtin._oreal_token_rm import (
    TokenRewardHead,
    cumulative_mean,
    oreal_token_weights,
    sequence_bce,
    topk_rescale,
)
from trl_plugins_builtin.oreal import KEEP_KEY, POSITIVE_KEY, SCALE_KEY, oreal_token_loss

TOKEN_RM = {"token_rm": True, "normalisation": "run"}


def sig(x):
    return 1 / (1 + math.exp(-x))


def test_threshold_weights_by_hand():
    scores = torch.tensor([[2.0, 0.0, -2.0, 9.0], [-2.0, -2.0, 4.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0]])  # row 0: last token is padding
    assert torch.allclose(cumulative_mean(scores, mask)[0, :3], torch.tensor([2.0, 1.0, 0.0]))
    w = oreal_token_weights(scores, mask, torch.tensor([True, False]))
    # positive row: clamp((p - 0.5) / 0.5, 0, 1) with p = sigmoid(2), sigmoid(1), sigmoid(0); padding 0
    assert torch.allclose(w[0], torch.tensor([2 * sig(2) - 1, 2 * sig(1) - 1, 0.0, 0.0]), atol=1e-6)
    # negative row: the same map of 1 - p; cumulative means -2, -2, 0, 0
    assert torch.allclose(w[1], torch.tensor([2 * sig(2) - 1, 2 * sig(2) - 1, 0.0, 0.0]), atol=1e-6)
    w_c = oreal_token_weights(scores, mask, torch.tensor([True, False]), correct_threshold=0.75)
    assert w_c[0, 0].item() == pytest.approx((sig(2) - 0.75) / 0.25, abs=1e-5) and w_c[0, 1] == 0.0  # sig(1) < 0.75


def test_topk_weights_by_hand():
    prob = torch.tensor([[0.9, 0.2, 0.7, 0.5, 0.99]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0]])  # 4 loss tokens: top int(4 * 0.5) = 2 of them
    assert torch.allclose(topk_rescale(prob, mask, 0.5), torch.tensor([[1.0, 0.0, 0.0, 0.0, 0.0]]))
    assert torch.allclose(topk_rescale(prob, mask, 0.75), torch.tensor([[1.0, 0.0, 0.5, 0.0, 0.0]]))


def test_sequence_bce_is_on_the_masked_mean_score():
    scores = torch.tensor([[1.0, 3.0, 100.0]])
    loss = sequence_bce(scores, torch.tensor([[1.0, 1.0, 0.0]]), torch.tensor([1.0]))
    assert loss.item() == pytest.approx(-math.log(sig(2.0)), rel=1e-6)


def _hidden_stats(hidden_c, mask):
    """A real HeadStats whose (B, T, d) completion states are ``hidden_c`` (one prompt position in front)."""
    B, T, d = hidden_c.shape
    hidden = torch.cat([torch.zeros(B, 1, d), hidden_c, torch.zeros(B, 1, d)], dim=1)  # (B, T + 2, d)
    return HeadStats(hidden, T, mask, torch.randn(7, d))


def _toy(seed=0, B=8, T=5, d=6):
    """Rows whose states carry +e0 when correct and -e0 when wrong (plus noise): learnable by a linear head."""
    g = torch.Generator().manual_seed(seed)
    positive = torch.tensor([b % 2 == 0 for b in range(B)])
    hidden = 0.3 * torch.randn(B, T, d, generator=g)
    hidden[..., 0] += torch.where(positive, 1.0, -1.0).unsqueeze(-1)
    return hidden, positive


def _loss_ctx(stats_hidden, positive, T, lp=None, iteration=0):
    B = positive.numel()
    mask = torch.ones(B, T)
    extras = {POSITIVE_KEY: positive.float(), SCALE_KEY: torch.ones(B), KEEP_KEY: torch.ones(B)}
    stats = _hidden_stats(stats_hidden, mask)
    return make_loss_context(lp, shape=(B, T), advantages=torch.where(positive, 1.0, -1.0), mask=mask,
                             extras=extras, head_stats=stats, iteration=iteration)


def test_loss_is_the_official_expression_with_token_weights():
    hidden, positive = _toy()
    stack = build_stack("oreal", {"oreal": TOKEN_RM}, loss_type="dapo")
    plugin = stack.plugins[0]
    g = torch.Generator().manual_seed(3)
    lp = (-2 * torch.rand(8, 5, generator=g)).requires_grad_(True)
    ctx = _loss_ctx(hidden, positive, 5, lp)
    stack.call("trl_plugins_loss", ctx)
    loss = loss_from_context(ctx)
    weights = oreal_token_weights(plugin.token_rm.scores(hidden), torch.ones(8, 5), positive)
    values = oreal_token_loss(lp, lp.detach(), torch.where(positive, 1.0, -1.0).unsqueeze(-1), positive,
                              torch.ones(8)) * weights
    assert torch.allclose(loss, values.sum() / 40)
    assert weights[positive].abs().sum() > 0 and weights[~positive].abs().sum() > 0
    assert plugin.token_rm.weight.grad is not None  # the head got its cross-entropy gradient ...
    assert {"plugins/oreal/token_rm_loss", "plugins/oreal/positive_token_weight"} <= set(ctx.metrics)


def test_head_training_reduces_its_loss_and_leaves_the_policy_gradient_alone():
    hidden, positive = _toy()
    stack = build_stack("oreal", {"oreal": {**TOKEN_RM, "token_rm_lr": 0.05}}, loss_type="dapo")
    plugin = stack.plugins[0]
    trainer = type("T", (), {})()

    def bce():
        with torch.no_grad():
            return sequence_bce(plugin.token_rm.scores(hidden), torch.ones(8, 5), positive.float()).mean().item()

    lp = torch.full((8, 5), -1.0, requires_grad=True)
    stack.call("trl_plugins_loss", _loss_ctx(hidden, positive, 5))  # builds the head
    start = bce()
    for step in range(1, 30):
        ctx = _loss_ctx(hidden, positive, 5, lp)
        stack.call("trl_plugins_loss", ctx)
        stack.call("trl_plugins_on_step_end", trainer=trainer, step=step)
    assert plugin.token_rm.steps >= 29 and bce() < 0.5 * start
    # the policy gradient is the weighted OREAL loss's: the head's cross-entropy adds nothing to it
    ctx = _loss_ctx(hidden, positive, 5, lp)
    stack.call("trl_plugins_loss", ctx)
    (grad,) = torch.autograd.grad(loss_from_context(ctx), lp)
    weights = oreal_token_weights(plugin.token_rm.scores(hidden), torch.ones(8, 5), positive)
    expected = torch.where(positive.unsqueeze(-1), -weights / 40, weights / 40)  # BC on +, ratio on -, A = +-1
    assert torch.allclose(grad, expected, atol=1e-6)
    # weights now follow the outcome: correct rows' tokens count, wrong rows' tokens count as errors
    assert weights[positive].mean() > 0.5 and weights[~positive].mean() > 0.5


def test_later_passes_and_eval_do_not_train_the_head():
    hidden, positive = _toy()
    stack = build_stack("oreal", {"oreal": TOKEN_RM}, loss_type="dapo")
    plugin = stack.plugins[0]
    stack.call("trl_plugins_loss", _loss_ctx(hidden, positive, 5, iteration=1))
    assert plugin.token_rm.weight.grad is None and plugin.token_rm.rows == 0


def test_actor_freeze_steps_zero_the_policy_loss_but_train_the_head():
    hidden, positive = _toy()
    stack = build_stack("oreal", {"oreal": {**TOKEN_RM, "actor_freeze_steps": 2}}, loss_type="dapo")
    plugin = stack.plugins[0]
    ctx = _loss_ctx(hidden, positive, 5)
    stack.call("trl_plugins_loss", ctx)
    assert loss_from_context(ctx).item() == 0.0 and plugin.token_rm.rows == 8
    stack.call("trl_plugins_on_step_end", trainer=None, step=2)
    ctx = _loss_ctx(hidden, positive, 5)
    stack.call("trl_plugins_loss", ctx)
    assert loss_from_context(ctx).item() != 0.0


def test_checkpoint_resume_restores_head_and_optimiser(tmp_path):
    hidden, positive = _toy()

    def run(stack, steps, start=1):
        for step in range(start, start + steps):
            stack.call("trl_plugins_loss", _loss_ctx(hidden, positive, 5))
            stack.call("trl_plugins_on_step_end", trainer=None, step=step)

    unbroken = build_stack("oreal", {"oreal": TOKEN_RM}, loss_type="dapo")
    run(unbroken, 4)
    first = build_stack("oreal", {"oreal": TOKEN_RM}, loss_type="dapo")
    run(first, 2)
    (state,) = [s for _, s in first.call("trl_plugins_state_dict")]
    state = load_plugin_state(save_plugin_state(state, str(tmp_path)))  # as the checkpoint stores it
    resumed = build_stack("oreal", {"oreal": TOKEN_RM}, loss_type="dapo")
    resumed.plugins[0].trl_plugins_load_state_dict(state)  # before the head is built, as on resume
    assert resumed.plugins[0].optimizer_steps == 2
    run(resumed, 2, start=3)
    a, b = unbroken.plugins[0].token_rm, resumed.plugins[0].token_rm
    assert a.steps == b.steps == 4 and torch.allclose(a.weight, b.weight, atol=1e-7)
    fresh = build_stack("oreal", {"oreal": TOKEN_RM}, loss_type="dapo")
    run(fresh, 2)  # without the state, two steps from the start differ from the resumed run
    assert not torch.allclose(fresh.plugins[0].token_rm.weight, b.weight)


def test_head_gradients_are_summed_over_processes():
    hidden, positive = _toy()
    single, split = TokenRewardHead(0.1, 0.0, 0.0), [TokenRewardHead(0.1, 0.0, 0.0) for _ in range(2)]
    for head in (single, *split):
        head.build(6, "cpu")
    mask = torch.ones(8, 5)
    single.accumulate(sequence_bce(single.scores(hidden), mask, positive.float()).sum(), 8)
    for p, head in enumerate(split):  # two processes with half the rows each, one all-reduce (sum)
        rows = slice(4 * p, 4 * p + 4)
        head.accumulate(sequence_bce(head.scores(hidden[rows]), mask[rows], positive[rows].float()).sum(), 4)
    grads = [torch.cat([h.weight.grad.flatten(), torch.tensor([h.rows])]) for h in split]
    total = grads[0] + grads[1]
    single.step()
    for head in split:
        head.step(lambda t: total)
    assert torch.allclose(split[0].weight, single.weight) and torch.allclose(split[1].weight, single.weight)


def test_bad_threshold_is_refused():
    with pytest.raises(PluginConfigError, match="correct_threshold"):
        build_stack("oreal", {"oreal": {**TOKEN_RM, "correct_threshold": 1.0}}, loss_type="dapo")


def test_tiny_run_trains_the_head():
    from trl_plugins.testing import digit_fraction_reward
    trainer = make_tiny_trainer(plugins=["oreal"], loss_type="dapo", max_steps=2, reward_funcs=[digit_fraction_reward],
                                plugin_config={"oreal": {**TOKEN_RM, "filter": "none", "success_threshold": 0.2}})
    plugin = trainer.plugin_stack.plugins[0]
    before = plugin.token_rm.weight.detach().clone()  # built at construction, on every process
    run = record_run(trainer)
    logs = {k: v for log in run.logs for k, v in log.items()}
    assert "plugins/oreal/token_rm_loss" in logs and plugin.token_rm.steps == 2
    assert not torch.equal(before, plugin.token_rm.weight)
    assert trainer.plugin_state_dict()["oreal"]["token_rm"]["steps"] == 2


def _frozen_run(freeze_steps):
    """Two steps of a tiny run with weight decay; the policy's parameters before and after."""
    from trl_plugins.testing import digit_fraction_reward
    trainer = make_tiny_trainer(plugins=["oreal"], loss_type="dapo", max_steps=2, reward_funcs=[digit_fraction_reward],
                                weight_decay=0.1,
                                plugin_config={"oreal": {**TOKEN_RM, "actor_freeze_steps": freeze_steps,
                                                         "filter": "none", "success_threshold": 0.2}})
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    run = record_run(trainer)
    return trainer, all(torch.equal(before[n], p) for n, p in run.params.items())


def test_actor_freeze_skips_the_policy_update():
    # official train_oreal.py:426-430: no actor update during the freeze. With weight decay a zeroed loss alone would
    # still move the policy; the skipped step leaves it and the optimizer state untouched.
    trainer, unchanged = _frozen_run(2)
    assert unchanged
    assert not any(trainer.optimizer.state.get(p) for p in trainer.model.parameters())
    assert trainer.plugin_stack.plugins[0].token_rm.steps == 2  # the head trained meanwhile
    _, unchanged = _frozen_run(1)  # one frozen step of two: the second step updates the policy
    assert not unchanged

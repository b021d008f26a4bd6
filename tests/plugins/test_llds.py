"""LLDS (official code vengdeng/LLDS @c19a094): the regulariser activates only when an action's
(or response's) likelihood dropped during the update and only on its tokens whose likelihood dropped; nothing
happens on-policy or with lam = 0; the gradient pushes exactly those log-probs up; end-to-end runs."""

import warnings
from types import SimpleNamespace

import pytest
import torch

from trl_plugins import IncompatiblePluginsError, PluginConfigError, build_plugins
from trl_plugins.testing import (
    assert_runs_equal,
    digit_fraction_reward,
    make_loss_context,
    make_tiny_trainer,
    record_run,
)
from trl_plugins_builtin.llds import action_ids, likelihood_gate, llds_penalty


def test_action_ids_number_contiguous_runs():
    p = torch.tensor([[1, 1, 0, 1, 0, 0, 1, 1], [0, 0, 0, 0, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1, 1, 1]]).bool()
    assert action_ids(p).tolist() == [[1, 1, 0, 2, 0, 0, 3, 3], [0] * 8, [1] * 8]


# Row 0: two actions (positions 0-2 and 5-7; 3-4 are tool-output tokens outside the loss mask), A >= 0.
#   action 1: drops +0.5, -0.25, +0.125 -> sum 0.375 > 0 -> gated; action 2: -0.25, +0.125, -0.125 -> -0.25 -> not.
# Row 1: A < 0: never preserved, whatever its drops. Row 2: A = 0 (preserved), one action whose drops sum to exactly
#   0 -> not gated (strict >). Row 3: A > 0, small total drop 0.0625 -> gated; its rising token gets no penalty.
# (Binary-exact values and lp_old = -4, so lp_old - lp reproduces DROP exactly.)
MASK = torch.tensor([[1, 1, 1, 0, 0, 1, 1, 1], [1, 1, 1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 0, 0, 0, 0],
                     [1, 1, 1, 0, 0, 0, 0, 0]])
ADV = torch.tensor([[0.7], [-1.0], [0.0], [0.3]]).expand(4, 8)
DROP = torch.tensor([
    [0.5, -0.25, 0.125, 1.0, 1.0, -0.25, 0.125, -0.125],
    [0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.0, 0.0],
    [0.25, -0.25, 0.125, -0.125, 0.0, 0.0, 0.0, 0.0],
    [0.0625, -0.03125, 0.03125, 0.0, 0.0, 0.0, 0.0, 0.0],
])
LP_OLD = torch.full((4, 8), -4.0)


def _set(*cells):
    out = torch.zeros(4, 8, dtype=torch.bool)
    for b, t in cells:
        out[b, t] = True
    return out


def test_action_gate_hand_made():
    preserve = MASK.bool() & (ADV >= 0)
    gated = likelihood_gate(DROP, preserve, "action", 0.0)
    assert torch.equal(gated, _set((0, 0), (0, 1), (0, 2), (3, 0), (3, 1), (3, 2)))


def test_response_gate_hand_made():
    preserve = MASK.bool() & (ADV >= 0)
    # row 0 response total: 0.375 - 0.25 = 0.125 > 0 -> the whole response is gated (both actions)
    gated = likelihood_gate(DROP, preserve, "response", 0.0)
    assert torch.equal(gated, _set((0, 0), (0, 1), (0, 2), (0, 5), (0, 6), (0, 7), (3, 0), (3, 1), (3, 2)))


def test_threshold():
    preserve = MASK.bool() & (ADV >= 0)
    gated = likelihood_gate(DROP, preserve, "action", 0.1)  # row 3's 0.0625 no longer counts
    assert torch.equal(gated, _set((0, 0), (0, 1), (0, 2)))


def _loss_ctx(lp, lp_old, adv, mask):
    B, T = lp.shape
    return make_loss_context(lp, old_per_token_logps=lp_old, advantages=adv, mask=mask, loss_type="dapo", iteration=1,
                             entropies=torch.zeros(B, T), completion_ids=torch.zeros(B, T, dtype=torch.long))


def test_loss_hook_penalises_only_responsible_tokens():
    """Penalty lam * max(0, lp_old - lp) on gated tokens; its gradient is -lam exactly where a gated token's
    likelihood dropped, 0 everywhere else (rising tokens, ungated actions, negative advantages, padding)."""
    lp_old = LP_OLD
    lp = (lp_old - DROP).requires_grad_(True)
    assert torch.equal(lp_old - lp.detach(), DROP)
    ctx = _loss_ctx(lp, lp_old, ADV, MASK)
    sink = ctx.metrics
    build_plugins(["llds"], {"llds": {"lam": 0.3}}).call("trl_plugins_loss", ctx)
    (term,) = ctx.token_terms
    responsible = _set((0, 0), (0, 2), (3, 0), (3, 2))  # gated and own drop > 0
    expected = torch.where(responsible, 0.3 * DROP, torch.zeros_like(DROP))
    torch.testing.assert_close(term.detach(), expected)
    (grad,) = torch.autograd.grad(term.sum(), lp)
    torch.testing.assert_close(grad, torch.where(responsible, torch.full_like(DROP, -0.3), torch.zeros_like(DROP)))
    n_valid = int(MASK.sum())
    assert sink["plugins/llds/gated_token_fraction"] == [pytest.approx(6 / n_valid)]
    assert sink["plugins/llds/regularised_token_fraction"] == [pytest.approx(4 / n_valid)]


def test_on_policy_and_lam_zero_are_neutral():
    lp = (-torch.rand(4, 8)).requires_grad_(True)
    ctx = _loss_ctx(lp, lp.detach().clone(), ADV, MASK)
    build_plugins(["llds"]).call("trl_plugins_loss", ctx)
    assert torch.all(ctx.token_terms[0] == 0)
    (grad,) = torch.autograd.grad(ctx.token_terms[0].sum(), lp)
    assert torch.all(grad == 0)
    ctx = _loss_ctx(lp, lp.detach() + DROP, ADV, MASK)
    build_plugins(["llds"], {"llds": {"lam": 0.0}}).call("trl_plugins_loss", ctx)
    assert torch.all(ctx.token_terms[0] == 0)


def test_penalty_function():
    lp = torch.tensor([[-1.0, -2.0, -3.0]], requires_grad=True)
    old = torch.tensor([[-0.5, -2.5, -1.0]])
    out = llds_penalty(lp, old, torch.tensor([[True, True, False]]))
    assert out.detach().tolist() == [[0.5, 0.0, 0.0]]


def test_configure_warns_when_the_policy_cannot_move_and_conflicts_with_gtpo():
    stack = build_plugins(["llds"])
    args = SimpleNamespace(steps_per_generation=1, gradient_accumulation_steps=1)
    with pytest.warns(UserWarning, match="never activates"):
        stack.call("trl_plugins_configure", trainer=SimpleNamespace(num_iterations=1), args=args)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        stack.call("trl_plugins_configure", trainer=SimpleNamespace(num_iterations=2), args=args)
    with pytest.raises(IncompatiblePluginsError, match="llds.*gtpo.*likelihood"):
        build_plugins(["llds", "gtpo"])
    with pytest.raises(PluginConfigError, match="gate"):
        build_plugins(["llds"], {"llds": {"gate": "token"}})


# ------------------------------------------------------------------------------------------ end to end (tiny model)
def _trainer(tmp_path, name, **config):
    return make_tiny_trainer(reward_funcs=[digit_fraction_reward], max_steps=2, output_dir=str(tmp_path / name),
                             **config)


def test_on_policy_end_to_end_is_vanilla(tmp_path):
    from trl import GRPOTrainer

    with pytest.warns(UserWarning, match="never activates"):
        trainer = _trainer(tmp_path, "a", plugins=["llds"])
    run = record_run(trainer)
    vanilla = record_run(_trainer(tmp_path, "b", trainer_cls=GRPOTrainer))
    assert_runs_equal(run, vanilla)


def test_end_to_end_activates_after_an_update(tmp_path):
    """Two micro-steps per generation batch (two groups): the second group is trained after an optimizer step on
    the first, so some of its good tokens lost likelihood and get regularised."""
    trainer = _trainer(tmp_path, "c", plugins=["llds"], steps_per_generation=2)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    run = record_run(trainer)
    assert any(not torch.equal(before[n], p) for n, p in run.params.items())
    logs = [log for log in run.logs if "loss" in log]
    assert len(logs) == 2
    assert logs[0]["plugins/llds/gated_token_fraction"] == 0.0  # first micro-step: policy = rollout policy
    assert logs[1]["plugins/llds/regularised_token_fraction"] > 0.0
    assert logs[1]["plugins/llds/gated_token_fraction"] >= logs[1]["plugins/llds/regularised_token_fraction"]

"""dno: DNO-Prct's best-vs-worst win-rate pairs and its contrastive loss -- the formula and the pair rule on small
tensors, the oracle (scripted generative judge, or the scalar reward), refusals, the neutral mix and trainer runs."""

import math

import pytest
import torch

from trl_plugins import IncompatiblePluginsError, PluginConfigError, build_plugins
from trl_plugins.api.services import RunInfo
from trl_plugins.components.genrm import clear_shared_genrm_backends
from trl_plugins.tasks.arithmetic import Problem, accuracy_reward, row_from_question
from trl_plugins.testing import (assert_reduces_to_vanilla, digit_fraction_reward, loss_from_context,
                                 make_advantage_context, make_loss_context, make_reward_context, make_tiny_trainer,
                                 record_run, script_generation)
from trl_plugins_builtin.dno import PAIR_EXTRA, REF_EXTRA, dno_loss, reward_preferences, select_pairs, win_rates

PROBLEM = Problem.from_expression([3, 4, 2], ["+", "*"])
RIGHT, WRONG, WORSE = PROBLEM.solution, "3+4=7\n7*2=15\nAnswer: 15", "3+4=8\n8*2=16\nAnswer: 16"


# ------------------------------------------------------------------------------------------ win rates and pairs
def test_win_rates_from_the_scalar_reward():
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.5, 2.0, float("nan")])
    pref = reward_preferences(rewards)
    assert pref[0, 1] == 1 and pref[1, 0] == 0 and pref[2, 3] == 0.5 and torch.isnan(pref[4, 5])
    rates = win_rates(pref, 3)
    # group 0: 1.0 beats both, 0.0 loses both, 0.5 beats 0.0 only
    assert rates[:3].tolist() == pytest.approx([1.0, 0.0, 0.5])
    # group 1: the NaN row has no judged pair; 0.5 vs 2.0 only for the others
    assert rates[3:5].tolist() == pytest.approx([0.0, 1.0]) and math.isnan(rates[5])


def test_win_rates_leave_unjudged_pairs_out():
    pref = torch.full((3, 3), math.nan)
    pref[0, 1], pref[1, 0] = 0.75, 0.25  # only (0, 1) judged
    assert win_rates(pref, 3)[:2].tolist() == pytest.approx([0.75, 0.25]) and math.isnan(win_rates(pref, 3)[2])


def test_pair_selection_best_vs_worst_with_the_margin_filter():
    rates = torch.tensor([0.5, 1.0, 0.0, 0.25,   # group 0: best row 1, worst row 2
                          0.5, 0.5, 0.5, 0.5,    # group 1: all tie -> no pair
                          0.6, 0.4, 0.55, 0.45,  # group 2: margin 0.2
                          float("nan"), 0.9, float("nan"), float("nan")])  # group 3: one valid row -> no pair
    codes = select_pairs(rates, 4, 0.0)
    assert codes.tolist() == [0, 1, -1, 0, 0, 0, 0, 0, 1, -1, 0, 0, 0, 0, 0, 0]
    filtered = select_pairs(rates, 4, 0.3)  # group 2's margin 0.2 is not above 0.3
    assert filtered.tolist() == [0, 1, -1, 0] + [0] * 12
    assert select_pairs(torch.tensor([0.2, 0.8, 0.2, 0.8]), 4, 0.0).tolist() == [-1, 1, 0, 0]  # ties: lower index


# ------------------------------------------------------------------------------------------ the loss
def test_loss_value_and_gradient_by_hand():
    s = torch.tensor([[0.3, -0.2, 0.1], [0.0, 0.4, -0.1]], requires_grad=True)
    codes = torch.tensor([[1.0, -1.0, 0.0], [0.0, 0.0, 0.0]])  # group 1 has no pair
    loss, z = dno_loss(s, codes, 0.5)
    assert z.tolist() == pytest.approx([0.5 * 0.5])
    assert loss.item() == pytest.approx(math.log(1 + math.exp(-0.25)))
    (grad,) = torch.autograd.grad(loss, s)
    g = -0.5 * (1 - 1 / (1 + math.exp(-0.25)))  # d/dz of -log sigmoid(z), times beta
    torch.testing.assert_close(grad, torch.tensor([[g, -g, 0.0], [0.0, 0.0, 0.0]]))


def test_on_policy_gradient_is_a_pair_policy_gradient():
    """At pi = pi_t (s = 0) the gradient is -beta/2 on the chosen and +beta/2 on the rejected, averaged over pairs:
    the closest equivalence to a policy gradient (advantages +-beta/2 on the pair, 0 elsewhere)."""
    s = torch.zeros(2, 4, requires_grad=True)
    codes = torch.tensor([[0.0, 1.0, 0.0, -1.0], [-1.0, 0.0, 1.0, 0.0]])
    loss, _ = dno_loss(s, codes, 0.1)
    assert loss.item() == pytest.approx(math.log(2))
    (grad,) = torch.autograd.grad(loss, s)
    torch.testing.assert_close(grad, -0.1 / 2 * codes / 2)


def test_no_pair_gives_a_connected_zero():
    s = torch.ones(1, 2, requires_grad=True)
    loss, z = dno_loss(s, torch.zeros(1, 2), 0.1)
    assert loss.item() == 0 and z.numel() == 0
    (grad,) = torch.autograd.grad(loss, s)
    assert torch.equal(grad, torch.zeros(1, 2))


LP = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -1.2, -2.2], [-0.7, -0.9, -1.1], [-2.0, -0.1, -4.0]])
OLD = LP - torch.tensor([[0.05, 0.0, 0.02], [-0.02, 0.01, 0.0], [0.0, 0.05, 0.0], [0.03, -0.01, 9.0]])
REF = LP - 0.3
MASK = torch.tensor([[1, 1, 1], [1, 1, 1], [1, 1, 1], [1, 1, 0]])
CODES = torch.tensor([-1.0, 1.0, 0.0, 0.0])  # group 0: row 1 chosen over row 0; group 1: no pair


def _loss_ctx(lp, **kw):
    return make_loss_context(lp, old_per_token_logps=OLD, advantages=torch.tensor([1.0, -1.0, 0.5, -0.5]), mask=MASK,
                             loss_type="grpo", num_generations=2,
                             extras={PAIR_EXTRA: CODES, REF_EXTRA: REF}, **kw)


@pytest.mark.parametrize("reference", ["previous", "initial"])
def test_loss_hook_takes_the_surrogate_place(reference):
    lp = LP.clone().requires_grad_(True)
    ctx = _loss_ctx(lp)
    build_plugins(["dno"], {"dno": {"reference": reference}}).call("trl_plugins_loss", ctx)
    base = REF if reference == "initial" else OLD
    s = ((lp - base) * MASK).sum(1).view(2, 2)  # padded tokens (the 9.0) do not count
    by_hand = torch.nn.functional.softplus(-0.1 * (s[0, 1] - s[0, 0]))
    total = loss_from_context(ctx)
    torch.testing.assert_close(total, by_hand)
    (g1,) = torch.autograd.grad(total, lp)
    (g2,) = torch.autograd.grad(by_hand, lp)
    torch.testing.assert_close(g1, g2)
    assert ctx.metrics["plugins/dno/pair_accuracy"] == [float(s[0, 1] > s[0, 0])]


def test_mix_interpolates_and_zero_switches_every_hook_off():
    lp = LP.clone().requires_grad_(True)
    losses = {}
    for mix in (None, 1.0, 0.5):
        ctx = _loss_ctx(lp)
        if mix is not None:
            build_plugins(["dno"], {"dno": {"mix": mix}}).call("trl_plugins_loss", ctx)
        losses[mix] = loss_from_context(ctx)
    torch.testing.assert_close(losses[0.5], 0.5 * losses[None] + 0.5 * losses[1.0])
    stack = build_plugins(["dno"], {"dno": {"mix": 0.0, "genrm": "scripted", "reference": "initial"}})
    assert not any(stack.has(h) for h in ("trl_plugins_loss", "trl_plugins_transform_advantages",
                                          "trl_plugins_transform_rewards"))
    assert not stack.needs_whole_groups and not list(stack)[0].needs_reference_model


# ------------------------------------------------------------------------------------------ the oracle
def test_advantage_stage_pairs_from_the_scalar_reward():
    stack = build_plugins(["dno"])
    ctx = make_advantage_context(torch.tensor([0.2, 0.9, 0.5, 0.7, 0.7, 0.7]), num_generations=3)
    before = ctx.advantages.clone()
    stack.call("trl_plugins_transform_advantages", ctx)
    assert ctx.extras[PAIR_EXTRA].tolist() == [-1, 1, 0, 0, 0, 0]  # group 1 all tie: no pair
    assert torch.equal(ctx.advantages, before)  # TRL's advantages are untouched (they serve mix < 1)
    assert ctx.metrics["plugins/dno/pair_fraction"] == [0.5]
    assert ctx.metrics["plugins/dno/win_rate_margin"] == [pytest.approx(1.0)]


def _reward_ctx(texts, G):
    N = len(texts)
    return make_reward_context(torch.zeros(N, 1), num_generations=G, reward_func_names=["accuracy_reward"],
                               reward_weights=[1.0], run=RunInfo(reward_func_names=("accuracy_reward",)),
                               rows=[{"prompt": [{"role": "user", "content": PROBLEM.question}]}] * N,
                               completions=[[{"role": "assistant", "content": t}] for t in texts])


@pytest.mark.parametrize("swap", [True, False])
def test_scripted_judge_win_rates_and_pairs(swap):
    clear_shared_genrm_backends()
    stack = build_plugins(["dno"], {"dno": {"genrm": "scripted", "position_swap": swap}})
    plugin = list(stack)[0]
    asked = []
    plugin.grm = plugin._build()
    original = plugin.grm.backend.ask
    plugin.grm.backend.ask = lambda convs: asked.extend(convs) or original(convs)
    ctx = _reward_ctx([WORSE, RIGHT, WRONG, WRONG, WRONG, RIGHT], 3)
    stack.call("trl_plugins_transform_rewards", ctx)
    # both orders of group 0's pair (WORSE, RIGHT) are asked with the swap, only the first without it
    orders = {("Answer: 16\n[End of Response A]" in m[-1]["content"], "Answer: 16\n[End of Response B]" in
               m[-1]["content"]) for m in asked}
    assert ((True, False) in orders) and (((False, True) in orders) == swap)
    # group 0: RIGHT beats both, WRONG (first error at step 2) beats WORSE (step 1); group 1: RIGHT beats both, the
    # WRONG-WRONG tie is "A" in either order: 1/2 with the swap, a win for the first row without it
    tie = 0.5 if swap else 1.0
    torch.testing.assert_close(plugin._rates, torch.tensor([0.0, 1.0, 0.5, (tie + 0) / 2, (1 - tie) / 2, 1.0]))
    assert ctx.metrics["plugins/dno/unparsable_fraction"] == [0.0]
    adv = make_advantage_context(torch.zeros(6), num_generations=3)
    stack.call("trl_plugins_transform_advantages", adv)
    expected = [-1, 1, 0] + ([-1, 0, 1] if swap else [0, -1, 1])
    assert adv.extras[PAIR_EXTRA].tolist() == expected
    clear_shared_genrm_backends()


# ------------------------------------------------------------------------------------------ construction
def test_bad_options_are_refused():
    for options, match in [({"beta": 0.0}, "beta"), ({"margin": 1.5}, "margin"), ({"reference": "sft"}, "'sft'"),
                           ({"genrm": "endpoint"}, "genrm_base_url"), ({"genrm": "gpt4"}, "'gpt4'"),
                           ({"mix": 2.0}, "mix"), ({"genrm": "scripted", "genrm_oracle": "chess"}, "genrm_oracle")]:
        with pytest.raises(PluginConfigError, match=match):
            build_plugins(["dno"], {"dno": options})
    build_plugins(["dno"], {"dno": {"genrm_base_url": None}})  # no oracle: the endpoint options are not needed


def test_whole_groups_and_judge_refusals(tmp_path):
    with pytest.raises(IncompatiblePluginsError, match="'dno'.*per_device_train_batch_size=2 is not a multiple"):
        make_tiny_trainer(plugins=["dno"], per_device_train_batch_size=2, gradient_accumulation_steps=2,
                          output_dir=str(tmp_path / "b"))
    plugin = list(build_plugins(["dno"], {"dno": {"genrm": "scripted"}}))[0]
    assert "generative judge" in plugin.image_inputs_refusal() and "genrm='none'" in plugin.multi_turn_refusal()
    assert list(build_plugins(["dno"]))[0].image_inputs_refusal() is None


# ------------------------------------------------------------------------------------------ runs
def test_neutral_mix_is_vanilla():
    """mix = 0 switches every hook off: the run equals trl.GRPOTrainer exactly (kit check)."""
    assert_reduces_to_vanilla("dno", {"mix": 0.0}, loss_types=("grpo",))


def test_trainer_run_with_the_scripted_judge(tmp_path):
    clear_shared_genrm_backends()
    trainer = make_tiny_trainer(plugins=["dno"], plugin_config={"dno": {"genrm": "scripted"}},
                                reward_funcs=[accuracy_reward, digit_fraction_reward], max_steps=2,
                                per_device_train_batch_size=4, num_generations=2, gradient_accumulation_steps=2,
                                output_dir=str(tmp_path), log_level="error")
    script_generation(trainer, lambda prompt, row: row_from_question(prompt)["solution"] if row % 2 == 0
                      else "1+1=3\nAnswer: 3")
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    run = record_run(trainer)
    assert any(not torch.equal(before[n], p) for n, p in run.params.items())
    assert all(math.isfinite(x) for x in run.losses)
    logs = [log for log in run.logs if "loss" in log]
    assert logs and all(log["plugins/dno/pair_fraction"] == 1.0 for log in logs)  # right vs wrong in every group
    assert all("plugins/dno/pair_accuracy" in log for log in logs)
    clear_shared_genrm_backends()


def test_trainer_run_on_the_scalar_reward_against_the_initial_policy(tmp_path):
    trainer = make_tiny_trainer(plugins=["dno"], plugin_config={"dno": {"reference": "initial"}},
                                reward_funcs=[digit_fraction_reward], max_steps=1, per_device_train_batch_size=4,
                                num_generations=2, gradient_accumulation_steps=2, output_dir=str(tmp_path),
                                log_level="error")
    run = record_run(trainer)
    assert all(math.isfinite(x) for x in run.losses)
    assert any("plugins/dno/pair_fraction" in log for log in run.logs)

"""rl_plus: RL-PLUS hybrid-policy optimisation (from the official code).

The MIS ratio and the Exploration-Based Advantage against their closed forms (bounds, gradients), the sampling hook
(demonstrations fill the first slots with EOS, truncated, off-policy with NaN sampling log-probs, G kept), refusals
at construction (missing column, no policy slot left), the loss hook (demonstration tokens only), the stack with the
loss-stage entropy plugin clip_cov, the neutral setting and a tiny-model run with demonstrations."""

import pytest
import torch

from trl_plugins import PluginConfigError
from trl_plugins.api.services import RunInfo
from trl_plugins.testing import (
    assert_group_sizes,
    assert_offpolicy_logprobs_nan,
    assert_reduces_to_vanilla,
    build_stack,
    char_encode,
    loss_from_context,
    make_loss_context,
    make_rollout_context,
    make_tiny_trainer,
    record_run,
    run_hook,
    stub_rows,
)
from trl_plugins_builtin.rl_plus import (
    demonstration_ids,
    demonstration_loss,
    exploration_weight,
    mis_ratio,
    strip_think_prefix,
)


def test_mis_ratio_closed_form_and_bounds():
    lp = torch.log(torch.tensor([[1e-6, 0.1, 0.5, 1.0]]))
    old = torch.log(torch.tensor([[0.5, 0.1, 1e-6, 1.0]]))
    r = mis_ratio(lp, old)
    expected = lp.exp() / (0.75 * old.exp() + 0.25)
    assert torch.allclose(r, expected)
    assert r.max() <= 4.0 and r[0, 3] == pytest.approx(1.0)  # p = p_old = 1 gives ratio 1
    # the point of MIS: a token the old policy found unlikely is bounded by 4 (plain IS p / p_old would be 5e5)
    assert r[0, 2] == pytest.approx(0.5 / (0.75e-6 + 0.25), rel=1e-5)


def test_exploration_weight_boosts_unlikely_tokens():
    lp = torch.log(torch.tensor([[0.01, 0.5, 0.99]]))
    w = exploration_weight(lp, 0.5)
    assert torch.allclose(w, (1 - lp.exp()).sqrt())
    assert w[0, 0] > w[0, 1] > w[0, 2]
    assert torch.equal(exploration_weight(lp, 0.0), torch.ones_like(lp))


def test_demonstration_loss_gradient():
    lp = torch.log(torch.tensor([[0.2, 0.7]])).requires_grad_(True)
    old = lp.detach() + torch.tensor([[0.1, -0.1]])
    adv = torch.tensor([[1.5]])
    demonstration_loss(lp, old, adv).sum().backward()
    p, p_old = lp.detach().exp(), old.exp()
    # d/dlog p of -A (1-p)^0.5 p / (0.75 p_old + 0.25), the EBA factor detached
    expected = -1.5 * (1 - p).sqrt() * p / (0.75 * p_old + 0.25)
    assert torch.allclose(lp.grad, expected)
    lp.grad = None
    demonstration_loss(lp, old, adv, off_policy_weight="none", eba_exponent=0.0).sum().backward()
    assert torch.allclose(lp.grad, -1.5 * p)  # 'no_reshape': -A p


def test_no_reshape_has_no_exploration_term():
    # official no_reshape (rlplus_core_alg.py:168-169): loss = -A * p_theta, whatever eta is
    lp = torch.log(torch.tensor([[0.2, 0.7]])).requires_grad_(True)
    old = lp.detach() + 0.3
    adv = torch.tensor([[-2.0]])
    loss = demonstration_loss(lp, old, adv, off_policy_weight="none", eba_exponent=0.5)
    torch.testing.assert_close(loss, torch.tensor([[0.4, 1.4]]))
    loss.sum().backward()
    torch.testing.assert_close(lp.grad, 2.0 * lp.detach().exp())
    # our variant keeps (1 - p)^eta on p
    eba = demonstration_loss(lp.detach(), old, adv, off_policy_weight="none_eba", eba_exponent=0.5)
    torch.testing.assert_close(eba, torch.tensor([[0.4 * 0.8 ** 0.5, 1.4 * 0.3 ** 0.5]]))


def test_think_prefix_is_stripped_when_the_prompt_opens_the_block():
    # official loader: prompt ends with "<think>\n" and the target starts with it -> the target loses it
    demo = "<think>\n1+1=2</think>\nAnswer: 2"
    rows = stub_rows(2, 4, solution=demo)
    prompts = [char_encode("Q0<think>\n")] * 4 + [char_encode("Q1")] * 4
    for options, first in (({}, demo[len("<think>\n"):]), ({"strip_think_prefix": False}, demo)):
        ctx = make_rollout_context([[f"try {j}" for j in range(4)]] * 2, rows=rows, prompt_ids=prompts,
                                   run=RunInfo(max_completion_length=64))
        run_hook("rl_plus", "trl_plugins_after_generation", ctx, {"rl_plus": options}, scale_rewards="none")
        assert ctx.completion_ids[0] == char_encode(first) + [0]
        assert ctx.completion_ids[4] == char_encode(demo) + [0]  # its prompt does not end with "<think>\n"
    assert strip_think_prefix("<think>\nabc", "x<think>\n") == "abc"
    assert strip_think_prefix("abc", "x<think>\n") == "abc"
    assert strip_think_prefix("<think>\nabc", "x<think>") == "<think>\nabc"


def _rollout(G=4, **kwargs):
    rows = stub_rows(2, G, solution=["1+1=2\nAnswer: 2", "2+2=4\nAnswer: 4"])
    completions = [[f"try {g}{j}" for j in range(G)] for g in range(2)]
    return make_rollout_context(completions, rows=rows, **kwargs)


def test_sampling_hook_puts_the_demonstration_in_the_first_slots():
    ctx = _rollout(run=RunInfo(max_completion_length=64))
    before = [list(x) for x in ctx.completion_ids]
    run_hook("rl_plus", "trl_plugins_after_generation", ctx, {"rl_plus": {"num_demonstrations": 2}},
             scale_rewards="none")
    for i in range(len(ctx)):
        if ctx.index_in_group[i] < 2:
            solution = ctx.rows[i]["solution"]
            assert ctx.completion_ids[i] == char_encode(solution) + [0]  # + EOS (the stub tokenizer's id 0)
            assert all(ctx.offpolicy[i]) and ctx.annotations[i]["demonstration"]
            assert not ctx.prompt_swapped[i]  # trained under the prompt it answers
        else:
            assert ctx.completion_ids[i] == before[i] and not any(ctx.offpolicy[i])
    assert_group_sizes(ctx)
    assert_offpolicy_logprobs_nan(ctx)
    assert ctx.metrics["plugins/rl_plus/demonstration_rows"] == [4]


def test_demonstrations_are_cut_to_max_completion_length():
    ctx = _rollout(run=RunInfo(max_completion_length=5))
    run_hook("rl_plus", "trl_plugins_after_generation", ctx, scale_rewards="none")
    assert ctx.completion_ids[0] == char_encode("1+1=2")
    assert demonstration_ids("ab", ctx.tokenizer, None) == char_encode("ab") + [0]


def test_blank_demonstration_in_a_row_names_the_row():
    rows = stub_rows(1, 4, solution="   ")
    ctx = make_rollout_context([["a", "b", "c", "d"]], rows=rows)
    with pytest.raises(PluginConfigError, match="row 0 has no demonstration in column 'solution'"):
        run_hook("rl_plus", "trl_plugins_after_generation", ctx, scale_rewards="none")


def test_missing_demonstration_column_is_refused_at_construction():
    with pytest.raises(PluginConfigError, match="teacher_trace"):
        make_tiny_trainer(plugins=["rl_plus"], plugin_config={"rl_plus": {"demonstration_column": "teacher_trace"}},
                          scale_rewards="none")


def test_a_group_keeps_a_policy_rollout():
    with pytest.raises(PluginConfigError, match="num_demonstrations"):
        build_stack("rl_plus", {"rl_plus": {"num_demonstrations": 4}}, num_generations=4, scale_rewards="none")


def test_loss_hook_replaces_only_demonstration_tokens():
    off = torch.tensor([[True, True, True, False], [False, False, False, False]])
    old = -torch.rand(2, 4, generator=torch.Generator().manual_seed(1))
    ctx = make_loss_context(shape=(2, 4), offpolicy_mask=off, old_per_token_logps=old)
    run_hook("rl_plus", "trl_plugins_loss", ctx, scale_rewards="none")
    mask, values = ctx.replacement
    assert torch.equal(mask, off)
    expected = demonstration_loss(ctx.per_token_logps, old, ctx.advantages)
    assert torch.allclose(values[off], expected[off])
    assert ctx.metrics["plugins/rl_plus/mis_ratio_mean"][0] > 0


def test_no_demonstration_token_no_replacement():
    ctx = make_loss_context(shape=(2, 4))
    run_hook("rl_plus", "trl_plugins_loss", ctx, scale_rewards="none")
    assert ctx.replacement is None
    assert "plugins/rl_plus/mis_ratio_mean" in ctx.metrics  # every process logs (collective-safe)


def test_stack_with_clip_cov_entropy_plugin():
    # rl_plus replaces the demonstration tokens; clip_cov (loss-stage entropy control) only ever zeroes policy tokens
    off = torch.zeros(4, 8, dtype=torch.bool)
    off[0] = True
    ctx = make_loss_context(shape=(4, 8), offpolicy_mask=off, advantages=torch.tensor([1.0, -1.0, 2.0, -0.5]))
    stack = build_stack(["rl_plus", "clip_cov"], {"clip_cov": {"lb": -100.0, "ub": 100.0, "ratio": 0.5}},
                        scale_rewards="none")
    run_hook(stack, "trl_plugins_loss", ctx)
    replaced, values = ctx.replacement
    assert torch.equal(replaced, off)
    (weights,) = ctx.token_weights
    assert (weights[~off] == 0).any()  # clip_cov detached some policy tokens
    assert (weights[off] == 1).all()  # and never a demonstration token
    loss = loss_from_context(ctx)
    composed = torch.where(off, values, ctx.per_token_loss.expand_as(values)) * weights
    assert torch.allclose(loss, composed.sum() / ctx.mask.sum())  # dapo: token sum over num_items_in_batch


def test_neutral_setting_is_vanilla():
    assert_reduces_to_vanilla("rl_plus", {"num_demonstrations": 0}, loss_types=("dr_grpo", "dapo"), steps=1,
                              scale_rewards="none")


def test_tiny_run_trains_on_demonstrations():
    trainer = make_tiny_trainer(plugins=["rl_plus"], scale_rewards="none", loss_type="dr_grpo", max_steps=1,
                                max_completion_length=48)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    run = record_run(trainer)
    logs = {k: v for log in run.logs for k, v in log.items()}
    assert logs["plugins/rl_plus/demonstration_rows"] > 0
    assert logs["plugins/rl_plus/demonstration_success_rate"] == 1.0  # the reference solution is correct
    assert 0 < logs["plugins/framework/offpolicy_token_fraction"] < 1
    assert any(not torch.equal(before[n], p) for n, p in trainer.model.named_parameters())

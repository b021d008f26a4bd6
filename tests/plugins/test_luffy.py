"""luffy: LUFFY's mixed groups (demonstrations in the first slots, shaped off-policy branch, no clip on them).

Hook tests on the kit's hand-made contexts; trainer-level runs on the tiny model check what the loss stage receives,
the neutral setting, a teacher as the source (local model; a dead endpoint), and the stacks with a loss-stage
entropy plugin (lp_reg, clip_cov)."""

import math
import socket

import pytest
import torch

from trl_plugins import Plugin, PluginConfigError, hookimpl
from trl_plugins.components.client import EndpointError
from trl_plugins.components.teacher import clear_shared_teachers
from trl_plugins.tasks.tiny import build_and_save
from trl_plugins.testing import (
    assert_reduces_to_vanilla,
    build_stack,
    digit_fraction_reward,
    make_advantage_context,
    make_loss_context,
    make_prompt_context,
    make_rollout_context,
    make_tiny_trainer,
    run_hook,
    stub_rows,
    stub_trainer,
    temporary_plugin,
    tiny_config,
    tiny_dataset,
    tiny_tokenizer,
)
from trl_plugins_builtin.luffy import DEMONSTRATION, demonstration_text, split_group_advantages

TOK = tiny_tokenizer()
EOS = TOK.eos_token_id


@pytest.fixture(autouse=True)
def _fresh_teachers():
    yield
    clear_shared_teachers()


def _ids(text):
    return TOK(text, add_special_tokens=False)["input_ids"]


# ------------------------------------------------------------------------------------------ options, bad input
def test_bad_options_are_refused_with_the_allowed_values():
    with pytest.raises(PluginConfigError, match=r"num_demonstrations=4 .* allowed: 0 \.\. 3"):
        build_stack("luffy", {"luffy": {"num_demonstrations": 4}}, num_generations=4, scale_rewards="none")
    with pytest.raises(PluginConfigError, match="teacher_base_url"):
        build_stack("luffy", {"luffy": {"source": "teacher", "teacher": "endpoint"}})
    with pytest.raises(PluginConfigError, match="teacher_model"):
        build_stack("luffy", {"luffy": {"source": "teacher"}})
    with pytest.raises(PluginConfigError, match="source"):
        build_stack("luffy", {"luffy": {"source": "expert"}})
    with pytest.raises(Exception, match="offpolicy_shaping_gamma"):
        build_stack("luffy", {"luffy": {"gamma": 0.5}})


def test_a_missing_or_blank_demonstration_column_is_refused_at_construction():
    with pytest.raises(PluginConfigError, match=r"needs the dataset column 'target'"):
        make_tiny_trainer(plugins=["luffy"], plugin_config={"luffy": {"demonstration_column": "target"}},
                          scale_rewards="none")
    blank = tiny_dataset().map(lambda row: {"solution": ""})
    with pytest.raises(PluginConfigError, match=r"column 'solution' is empty"):
        make_tiny_trainer(plugins=["luffy"], dataset=blank, scale_rewards="none")


def test_std_scaled_advantages_are_warned_about():
    with pytest.warns(UserWarning, match="scale_rewards='none'"):
        build_stack("luffy", num_generations=4)


# ------------------------------------------------------------------------------------------ sampling hooks
def test_the_first_slots_of_each_group_are_deferred_and_marked():
    ctx = make_prompt_context(num_groups=2, num_generations=4)
    run_hook("luffy", "trl_plugins_generation_prompts", ctx, {"luffy": {"num_demonstrations": 2}},
             scale_rewards="none")
    assert ctx.deferred == [True, True, False, False] * 2
    assert [bool(a.get(DEMONSTRATION)) for a in ctx.annotations] == ctx.deferred


def test_deferred_slots_are_filled_with_the_demonstration_off_policy_with_nan_logprobs():
    rows = stub_rows(2, 4, solution=["1+1=2\nAnswer: 2", "2+3=5\nAnswer: 5"])
    annotations = [{DEMONSTRATION: True} if i % 4 == 0 else {} for i in range(8)]
    ctx = make_rollout_context([["", "a", "b", "c"], ["", "d", "e", "f"]], rows=rows, tokenizer=TOK,
                               deferred=[0, 4], annotations=annotations)
    before = [list(ids) for ids in ctx.completion_ids]
    run_hook("luffy", "trl_plugins_after_generation", ctx, scale_rewards="none")
    assert ctx.completion_ids[0] == _ids("1+1=2\nAnswer: 2") + [EOS]
    assert ctx.completion_ids[4] == _ids("2+3=5\nAnswer: 5") + [EOS]
    for i in (0, 4):
        assert all(ctx.offpolicy[i]) and all(math.isnan(x) for x in ctx.sampling_logprobs[i])
        assert not ctx.prompt_swapped[i]  # trained under the original prompt it was written for
    for i in (1, 2, 3, 5, 6, 7):  # the policy's rollouts are untouched
        assert ctx.completion_ids[i] == before[i] and not any(ctx.offpolicy[i])
    assert ctx.metrics["plugins/luffy/teacher_rollouts"] == [2.0]


def test_a_leading_think_tag_is_dropped_when_the_prompt_ends_with_one():
    # official loader (rl_dataset_with_target.py:129-130): prompt ending "<think>\n" + target starting with it
    demo = "<think>\n1+1=2</think>\nAnswer: 2"
    rows = stub_rows(2, 4, solution=demo)
    annotations = [{DEMONSTRATION: True} if i % 4 == 0 else {} for i in range(8)]
    prompts = [_ids("Q0<think>\n")] * 4 + [_ids("Q1")] * 4
    for options, first in (({}, demo[len("<think>\n"):]), ({"strip_think_prefix": False}, demo)):
        ctx = make_rollout_context([["", "a", "b", "c"], ["", "d", "e", "f"]], rows=rows, tokenizer=TOK,
                                   deferred=[0, 4], annotations=[dict(a) for a in annotations], prompt_ids=prompts)
        run_hook("luffy", "trl_plugins_after_generation", ctx, {"luffy": options}, scale_rewards="none")
        assert ctx.completion_ids[0] == _ids(first) + [EOS]
        assert ctx.completion_ids[4] == _ids(demo) + [EOS]


def test_a_list_column_gives_each_slot_its_own_demonstration_and_a_blank_row_is_an_error():
    assert demonstration_text(["x", "y"], 0) == "x" and demonstration_text(["x", "y"], 3) == "y"
    assert demonstration_text("  ", 0) is None and demonstration_text([], 0) is None
    rows = stub_rows(1, 4, solution=[["first", "second"]])
    annotations = [{DEMONSTRATION: True}] * 2 + [{}] * 2
    ctx = make_rollout_context([["", "", "a", "b"]], rows=rows, tokenizer=TOK, deferred=[0, 1],
                               annotations=annotations)
    run_hook("luffy", "trl_plugins_after_generation", ctx, {"luffy": {"num_demonstrations": 2, "append_eos": False}},
             scale_rewards="none")
    assert ctx.completion_ids[:2] == [_ids("first"), _ids("second")]
    rows = stub_rows(1, 4, solution=[""])
    ctx = make_rollout_context([["", "a", "b", "c"]], rows=rows, tokenizer=TOK, deferred=[0],
                               annotations=[{DEMONSTRATION: True}, {}, {}, {}])
    with pytest.raises(PluginConfigError, match="row 0 has no demonstration in column 'solution'"):
        run_hook("luffy", "trl_plugins_after_generation", ctx, scale_rewards="none")


# ------------------------------------------------------------------------------------------ advantage and loss
def test_on_policy_baseline_is_the_official_split_estimator():
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0])
    demo = torch.tensor([True, False, False, False] * 2)
    adv = split_group_advantages(rewards, torch.arange(8) // 4, ~demo, scale=False)
    # group 0: on-policy mean 1/3; group 1: on-policy mean 0 (the demonstration's 1 is not in the baseline)
    assert torch.allclose(adv, torch.tensor([2 / 3, -1 / 3, 2 / 3, -1 / 3, 1.0, 0.0, 0.0, 0.0]))
    scaled = split_group_advantages(rewards, torch.arange(8) // 4, ~demo, scale=True)
    std = torch.tensor([0.0, 1.0, 1.0]).std()
    assert torch.allclose(scaled[:4], adv[:4] / (std + 1e-6)) and torch.allclose(scaled[4:], adv[4:])  # std 0 -> 1
    ctx = make_advantage_context(rewards, num_generations=4, scale_rewards=False,
                                 annotations=[{DEMONSTRATION: bool(d)} for d in demo])
    run_hook("luffy", "trl_plugins_transform_advantages", ctx, {"luffy": {"advantage_baseline": "on_policy"}},
             scale_rewards="none")
    assert torch.allclose(ctx.advantages, adv)
    assert ctx.metrics["plugins/luffy/demonstration_advantage"] == [pytest.approx(adv[demo].mean().item())]
    untouched = make_advantage_context(rewards, num_generations=4, scale_rewards=False)  # eval batch: no demos
    original = untouched.advantages.clone()
    run_hook("luffy", "trl_plugins_transform_advantages", untouched, {"luffy": {"advantage_baseline": "on_policy"}},
             scale_rewards="none")
    assert torch.equal(untouched.advantages, original)


def test_the_default_baseline_keeps_trl_advantages_and_logs_the_demonstrations_mean():
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0])
    demo = [True, False, False, False] * 2
    ctx = make_advantage_context(rewards, num_generations=4, scale_rewards=False,
                                 annotations=[{DEMONSTRATION: d} for d in demo])
    original = ctx.advantages.clone()
    run_hook("luffy", "trl_plugins_transform_advantages", ctx, {}, scale_rewards="none")
    assert torch.equal(ctx.advantages, original)
    # group 0: mean 1/2, its demonstration 1 -> +1/2; group 1: mean 1/4, its demonstration 1 -> +3/4
    assert ctx.metrics["plugins/luffy/demonstration_advantage"] == [pytest.approx(0.625)]


def test_demonstration_tokens_are_shaped_and_never_clipped():
    """The framework's branch the plugin relies on: -A p/(p+0.1) on off-policy tokens whatever the ratio."""
    lp = torch.log(torch.tensor([[0.05, 0.5, 0.9], [0.05, 0.5, 0.9]])).requires_grad_(True)
    old = lp.detach() - 2.0  # ratio e^2, far outside the clip range: policy tokens are clipped (no gradient)
    off = torch.tensor([[True, True, True], [False, False, False]])
    ctx = make_loss_context(lp, old_per_token_logps=old, advantages=torch.tensor([1.0, 1.0]), offpolicy_mask=off,
                            loss_type="dr_grpo")
    ctx.per_token_loss.sum().backward()
    p = lp.detach().exp()
    assert torch.allclose(lp.grad[0], -0.1 * p[0] / (p[0] + 0.1) ** 2)  # d(-p/(p+g))/dlogp
    assert torch.equal(lp.grad[1], torch.zeros(3))  # clipped on-policy tokens


# ------------------------------------------------------------------------------------------ trainer level
class LossProbe(Plugin):
    """Records the rollout rows and the loss-stage provenance of a luffy run."""

    name = "test_luffy_probe"
    seen: dict = {}

    @hookimpl
    def trl_plugins_after_generation(self, ctx):
        LossProbe.seen.setdefault("rollouts", []).append(
            [(list(ids), list(off), dict(a)) for ids, off, a in zip(ctx.completion_ids, ctx.offpolicy, ctx.annotations)])

    @hookimpl
    def trl_plugins_loss(self, ctx):
        LossProbe.seen.setdefault("offpolicy_rows", []).append(ctx.offpolicy_mask.any(-1).sum().item())


def test_a_run_trains_demonstrations_in_slot_zero_at_the_policy_cost_of_g_minus_one(tmp_path):
    LossProbe.seen = {}
    data = tiny_dataset(4)
    with temporary_plugin(LossProbe):
        trainer = make_tiny_trainer(plugins=["luffy", "test_luffy_probe"], dataset=data, scale_rewards="none",
                                    loss_type="dr_grpo", max_steps=1, max_completion_length=40, output_dir=str(tmp_path))
        sampled = []
        original = trainer._generate_single_turn

        def counting(prompt_ids, *args, **kwargs):
            sampled.append(len(prompt_ids))
            return original(prompt_ids, *args, **kwargs)

        trainer._generate_single_turn = counting
        trainer.train()
    rows = LossProbe.seen["rollouts"][0]
    solutions = {tuple(_ids(s) + [EOS]) for s in data["solution"]}
    for k, (ids, off, ann) in enumerate(rows):
        if k % 4 == 0:
            assert tuple(ids) in solutions and all(off) and ann[DEMONSTRATION]
        else:
            assert not any(off)
    assert sampled == [3]  # one group of G=4 per step: 3 policy rollouts, the demonstration costs none
    assert sum(LossProbe.seen["offpolicy_rows"]) == 1
    logs = {k: v for e in trainer.state.log_history for k, v in e.items()}
    assert logs["plugins/luffy/teacher_rollouts"] == 1.0 and logs["plugins/framework/extra_rollouts"] == 0.0


def test_neutral_setting_reduces_to_vanilla():
    assert_reduces_to_vanilla("luffy", {"num_demonstrations": 0})


def test_a_local_teacher_can_write_the_demonstrations(tmp_path):
    path = build_and_save(tmp_path / "teacher", hidden_size=16, num_layers=1, num_heads=2)
    trainer = make_tiny_trainer(plugins=["luffy"], scale_rewards="none", max_steps=1, output_dir=str(tmp_path),
                                plugin_config={"luffy": {"source": "teacher", "teacher_model": str(path),
                                                         "teacher_max_tokens": 6}})
    calls = []
    original = trainer.plugin_stack.by_name["luffy"].teacher.chat
    trainer.plugin_stack.by_name["luffy"].teacher.chat = lambda c, **k: calls.append(c) or original(c, **k)
    trainer.train()
    assert calls and len(calls[0]) == 1 and calls[0][0][-1]["role"] == "user"  # one demonstration per group


def test_a_dead_teacher_endpoint_stops_the_run_with_its_url(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}/v1"
    trainer = make_tiny_trainer(plugins=["luffy"], scale_rewards="none", max_steps=1, output_dir=str(tmp_path),
                                plugin_config={"luffy": {"source": "teacher", "teacher": "endpoint",
                                                         "teacher_base_url": url, "teacher_max_retries": 1}})
    trainer.plugin_stack.by_name["luffy"].teacher.client.config.backoff = 0.01
    with pytest.raises(EndpointError, match=rf"{url}/chat/completions failed after 2 attempts"):
        trainer.train()


# ------------------------------------------------------------------------------------------ stacks
def test_lp_reg_never_replaces_the_shaped_branch_of_demonstration_tokens():
    stack = build_stack(["luffy", "lp_reg"], {"lp_reg": {"rho": 1.0, "proxy_source": "current",
                                                         "selection_scope": "microbatch"}}, scale_rewards="none")
    lp = torch.log(torch.tensor([[0.01, 0.02, 0.03], [0.01, 0.02, 0.03]])).requires_grad_(True)
    off = torch.tensor([[True, True, True], [False, False, False]])

    class Head:  # a proxy above every token's log-prob: every selected token would be regularised
        def min_p_logprob(self, ids, kappa, mode):
            return torch.zeros(2, 3)

    ctx = make_loss_context(lp, advantages=torch.tensor([-1.0, -1.0]), offpolicy_mask=off, head_stats=Head())
    shaped = ctx.per_token_loss.detach().clone()
    run_hook(stack, "trl_plugins_loss", ctx)
    mask, values = ctx.replacement
    assert not mask[0].any() and mask[1].all()  # only the policy's tokens are regularised
    assert torch.equal(shaped[0], torch.where(mask, values, ctx.per_token_loss)[0].detach())


@pytest.mark.parametrize("entropy_plugin, options", [
    ("lp_reg", {"rho": 0.5}),
    ("clip_cov", {"lb": -100.0, "ub": 100.0, "ratio": 0.2}),
])
def test_luffy_stacked_with_a_loss_stage_entropy_plugin_trains(entropy_plugin, options, tmp_path):
    trainer = make_tiny_trainer(plugins=["luffy", entropy_plugin], plugin_config={entropy_plugin: options},
                                reward_funcs=[digit_fraction_reward], scale_rewards="none", loss_type="dr_grpo",
                                max_steps=2, output_dir=str(tmp_path))
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    logs = {k: v for e in trainer.state.log_history for k, v in e.items()}
    assert logs["plugins/luffy/teacher_rollouts"] == 1.0  # one group of G=4 per generation batch
    assert logs["plugins/framework/offpolicy_token_fraction"] > 0
    assert any(k.startswith(f"plugins/{entropy_plugin}/") for k in logs)
    assert any(not torch.equal(before[n], p) for n, p in trainer.model.named_parameters())
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())


def test_configure_refuses_rollout_func(tmp_path):
    args = tiny_config(str(tmp_path), plugins=["luffy"], scale_rewards="none")
    with pytest.raises(PluginConfigError, match="rollout_func"):
        build_stack("luffy", scale_rewards="none", trainer=stub_trainer(args, rollout_func=lambda *a: None))

"""AEPO: entropy-aware advantages, the gradient-preserving upper clip and the dual clip on small tensors, the neutral
setting, construction checks and runs on the tiny model; the rollout half (branching): the pre-monitoring budget split
and the consecutive-branch penalty on small values, its refusals, and runs on the tiny tool trainer."""

from types import SimpleNamespace

import pytest
import torch

from trl_plugins import IncompatiblePluginsError, Plugin, PluginConfigError, build_plugins, hookimpl
from trl_plugins.testing import (assert_reduces_to_vanilla, assert_runs_equal, digit_fraction_reward, loss_from_context,
                                 make_loss_context, make_tiny_trainer, make_tool_trainer, record_run,
                                 temporary_plugin)
from trl_plugins_builtin._tool_branching import plan_branches
from trl_plugins_builtin.aepo import BRANCH_KEY, entropy_scaled_advantages, global_rollouts, penalized_branch

OFF = {"balanced_clipping": False, "entropy_advantage_coef": 0.0, "dual_clip": None}


def test_entropy_scaled_advantages_hand_made():
    adv = torch.tensor([[1.0, 1.0, 1.0], [-2.0, -2.0, -2.0]])
    ent = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 99.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    valid = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0])  # mean 3, unbiased std sqrt(2.5); the masked 99 does not count
    z = (ent - 3.0) / valid.std()
    torch.testing.assert_close(entropy_scaled_advantages(adv, ent, mask, 0.2), adv * (1 + 0.2 * z))
    assert entropy_scaled_advantages(adv, ent, mask, 0.2)[0, 2] == 1.0  # the mean entropy keeps A


def test_entropy_scaled_advantages_constant_entropy_and_no_gradient():
    adv = torch.tensor([[1.0, -1.0]])
    ent = torch.full((1, 2), 0.7, requires_grad=True)
    out = entropy_scaled_advantages(adv, ent, torch.ones(1, 2), 0.2)
    assert torch.equal(out, adv) and not out.requires_grad  # std 0 -> 1, z = 0; z is detached


# rows: A > 0 with r above 1 + eps_high at (0, 1); A < 0 with r above the dual-clip constant 3 at (1, 2) and below
# 1 - eps_low at (1, 0) (a hard lower clip, kept)
LP = torch.tensor([[-1.0, -1.0, -1.0], [-1.0, -1.0, -1.0]])
OLD = LP - torch.tensor([[0.0, 0.5, 0.1], [-0.5, 0.0, 1.5]])  # r = e^0.5 = 1.65, e^0.1 = 1.105, e^-0.5, e^1.5 = 4.48
ADV = torch.tensor([1.0, -2.0])


def _ctx(lp, **kw):
    return make_loss_context(lp, old_per_token_logps=OLD, advantages=ADV, loss_type="dapo", epsilon_low=0.2,
                             epsilon_high=0.28, entropies=torch.ones(2, 3), **kw)


def test_upper_clip_keeps_the_gradient_and_dual_clip_caps_negatives():
    lp = LP.clone().requires_grad_(True)
    ctx = _ctx(lp)
    build_plugins(["aepo"], {"aepo": {"entropy_advantage_coef": 0.0}}).call("trl_plugins_loss", ctx)
    repl, values = ctx.replacement
    expected = torch.zeros(2, 3, dtype=torch.bool)
    expected[0, 1] = expected[1, 2] = True
    assert torch.equal(repl, expected)
    base_ctx = _ctx(lp)
    # the upper-clipped token keeps its value -A (1 + eps_high); the dual-clipped one becomes -A c = 6 < 2 e^1.5
    assert values[0, 1].item() == pytest.approx(base_ctx.per_token_loss[0, 1].item())
    assert values[1, 2].item() == pytest.approx(6.0)
    assert base_ctx.per_token_loss[1, 2].item() == pytest.approx(2 * torch.e ** 1.5, rel=1e-5)
    (grad,) = torch.autograd.grad(loss_from_context(ctx), lp)
    (base_grad,) = torch.autograd.grad(loss_from_context(base_ctx), lp)
    assert base_grad[0, 1] == 0 and grad[0, 1].item() == pytest.approx(-1.0 * 1.28 / 6)  # dapo: over 6 tokens
    assert grad[1, 2] == 0 and base_grad[1, 2] != 0
    assert grad[1, 0] == 0 and base_grad[1, 0] == 0  # the lower clip stays hard
    keep = ~expected
    torch.testing.assert_close(grad[keep], base_grad[keep])
    assert ctx.metrics["plugins/aepo/preserved_clip_fraction"] == [pytest.approx(1 / 6)]
    assert ctx.metrics["plugins/aepo/dual_clip_fraction"] == [pytest.approx(1 / 6)]


def test_each_part_alone():
    lp = LP.clone().requires_grad_(True)
    ctx = _ctx(lp)
    build_plugins(["aepo"], {"aepo": {**OFF, "balanced_clipping": True}}).call("trl_plugins_loss", ctx)
    assert ctx.replacement[0].nonzero().tolist() == [[0, 1]]
    ctx = _ctx(lp)
    build_plugins(["aepo"], {"aepo": {**OFF, "dual_clip": 5.0}}).call("trl_plugins_loss", ctx)  # r = 4.48 < 5
    assert ctx.replacement is None


def test_entropy_advantage_hook_shapes_the_surrogate():
    ent = torch.tensor([[0.5, 1.0, 1.5], [2.0, 2.5, 3.0]])
    lp = LP.clone().requires_grad_(True)
    ctx = make_loss_context(lp, advantages=ADV, entropies=ent, loss_type="dapo")
    ctx.advantages = ctx.advantages.expand(-1, 3).clone()
    build_plugins(["aepo"], {"aepo": {**OFF, "entropy_advantage_coef": 0.2}}).call("trl_plugins_loss_advantages", ctx)
    torch.testing.assert_close(ctx.advantages, entropy_scaled_advantages(ADV.view(2, 1).expand(2, 3), ent,
                                                                         torch.ones(2, 3), 0.2))


def test_neutral_options_switch_every_hook_off():
    stack = build_plugins(["aepo"], {"aepo": OFF})
    assert not stack.has("trl_plugins_loss") and not stack.has("trl_plugins_loss_advantages")


def test_option_validation_and_loss_types(tmp_path):
    with pytest.raises(PluginConfigError, match="dual_clip"):
        build_plugins(["aepo"], {"aepo": {"dual_clip": 1.0}})
    with pytest.raises(PluginConfigError, match="entropy_advantage_coef"):
        build_plugins(["aepo"], {"aepo": {"entropy_advantage_coef": -0.1}})
    with pytest.raises(IncompatiblePluginsError, match="aepo.*cispo"):
        make_tiny_trainer(plugins=["aepo"], loss_type="cispo", output_dir=str(tmp_path))
    with pytest.raises(IncompatiblePluginsError, match="aepo.*reg_grpo|reg_grpo.*aepo"):
        build_plugins(["aepo", "reg_grpo"])


def _trainer(tmp_path, name, **config):
    return make_tiny_trainer(reward_funcs=[digit_fraction_reward], max_steps=2, output_dir=str(tmp_path / name),
                             **config)


def test_neutral_setting_is_vanilla():
    """The neutral setting switches every hook off: the run equals trl.GRPOTrainer exactly (kit check)."""
    assert_reduces_to_vanilla("aepo", OFF, loss_types=("grpo", "dapo"))

def test_end_to_end_off_policy_micro_step(tmp_path):
    """steps_per_generation=2 with one accumulation step: the second micro-step has r != 1, so the clips can act."""
    trainer = _trainer(tmp_path, "r", plugins=["aepo"], steps_per_generation=2, learning_rate=0.05)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    run = record_run(trainer)
    assert any(not torch.equal(before[n], p) for n, p in run.params.items())
    logs = [log for log in run.logs if "loss" in log]
    assert logs and all("plugins/aepo/preserved_clip_fraction" in log for log in logs)


# ------------------------------------------------------------------------------------- the rollout half (branching)
def test_pre_monitoring_budget_split_hand_made():
    # m = clamp(int(G sigmoid(0.5 (H_root - H_tool))) + 1, 1, G)
    assert global_rollouts(0.3, 0.3, 16, 0.5) == 9  # sigmoid(0) = 0.5: 8 + 1
    assert global_rollouts(2.0, 0.0, 4, 0.5) == 3  # 4 sigmoid(1) = 2.92 -> 2 + 1
    assert global_rollouts(0.0, 2.0, 4, 0.5) == 2  # 4 sigmoid(-1) = 1.08 -> 1 + 1
    assert global_rollouts(0.0, 2.0, 4, 0.0) == 3  # no scale: always half + 1
    assert global_rollouts(100.0, 0.0, 4, 0.5) == 4  # clamped to the group
    assert global_rollouts(0.0, 100.0, 1, 0.5) == 1


def test_branch_test_with_consecutive_branch_penalty_hand_made():
    # score = clip((u + w dH) max(0, 1 - 0.05 c), 0, 1) >= 0.5
    assert penalized_branch(0.55, 0.0, 0, 0.2, 0.5, 0.05)
    assert not penalized_branch(0.55, 0.0, 2, 0.2, 0.5, 0.05)  # 0.55 * 0.9 = 0.495
    assert penalized_branch(0.45, 0.5, 0, 0.2, 0.5, 0.05)  # 0.45 + 0.1: an entropy rise helps
    assert not penalized_branch(0.45, 0.5, 2, 0.2, 0.5, 0.05)  # 0.55 * 0.9 = 0.495
    assert penalized_branch(0.45, 0.5, 2, 0.2, 0.5, 0.0)  # no penalty: ARPO's odds
    assert not penalized_branch(0.99, 10.0, 20, 0.2, 0.1, 0.05)  # factor clipped to 0
    assert penalized_branch(0.0, -10.0, 0, 0.2, 0.0, 0.05)  # threshold 0: always


def _draw(values):
    it = iter(values)
    return lambda: next(it)


def test_consecutive_branches_are_penalised_and_the_streak_resets():
    decide = lambda u, delta, streak: penalized_branch(u, delta, streak, 0.0, 0.5, 0.05)  # noqa: E731
    sources = [(0, [0.1, 0.1, 0.1, 0.1])]  # boundaries 1, 2, 3
    # u = 0.52 each time: branch at 1 (streak 0), not at 2 (0.52 * 0.95 = 0.494), again at 3 (streak reset)
    assert plan_branches(sources, 3, 2, decide, [_draw([0.52] * 3)]) == [(0, 1), (0, 3)]
    # without the penalty every boundary branches
    arpo_like = lambda u, delta, streak: penalized_branch(u, delta, streak, 0.0, 0.5, 0.0)  # noqa: E731
    assert plan_branches(sources, 3, 2, arpo_like, [_draw([0.52] * 3)]) == [(0, 1), (0, 2), (0, 3)]
    # the streak is the group's: a branch of another root at boundary 1 penalises row 0 at boundary 2
    two = [(0, [0.1, 0.1, 0.1]), (1, [0.1, 0.1])]
    assert plan_branches(two, 3, 2, decide, [_draw([0.4, 0.52]), _draw([0.6])]) == [(1, 1)]
    assert plan_branches(two, 3, 2, arpo_like, [_draw([0.4, 0.52]), _draw([0.6])]) == [(1, 1), (0, 2)]


@pytest.mark.parametrize("options, message", [
    ({"branching": True, "initial_rollouts": 2}, "'initial_rollouts'.*dynamic_rollouts=True"),
    ({"initial_rollouts": 0, "dynamic_rollouts": False}, "initial_rollouts"),
    ({"beam_size": 0}, "beam_size"),
    ({"branch_probability": 1.5}, "branch_probability"),
    ({"entropy_weight": -0.1}, "entropy_weight"),
    ({"branch_penalty": -0.05}, "branch_penalty"),
    ({"budget_scale": -1.0}, "budget_scale"),
    ({"entropy_tokens": 0}, "entropy_tokens"),
])
def test_bad_branching_options_are_refused_at_construction(options, message):
    with pytest.raises(PluginConfigError, match=message):
        build_plugins(["aepo"], {"aepo": options})


def test_branching_is_off_by_default_and_refused_under_vllm():
    assert not build_plugins(["aepo"]).has("trl_plugins_after_generation")
    assert build_plugins(["aepo"], {"aepo": {"branching": True}}).has("trl_plugins_after_generation")
    plugin = build_plugins(["aepo"], {"aepo": {"branching": True}}).plugins[0]
    assert plugin.image_inputs_refusal() and build_plugins(["aepo"]).plugins[0].image_inputs_refusal() is None
    with pytest.raises(IncompatiblePluginsError, match="aepo's branching.*use_vllm"):
        plugin.trl_plugins_configure(None, SimpleNamespace(num_generations=4, seed=0, use_vllm=True))
    off = build_plugins(["aepo"]).plugins[0]
    off.trl_plugins_configure(None, SimpleNamespace(num_generations=4, seed=0, use_vllm=True))  # nothing to refuse


def test_more_global_rollouts_than_the_group_is_refused(tmp_path):
    config = {"branching": True, "dynamic_rollouts": False, "initial_rollouts": 5}
    with pytest.raises(PluginConfigError, match=r"'initial_rollouts'.*got 5 with num_generations=4.*<= num_gen"):
        make_tool_trainer(plugins=["aepo"], plugin_config={"aepo": config}, max_steps=1, output_dir=str(tmp_path))


@pytest.mark.slow
def test_branching_without_a_slot_is_aepo_without_branching(tmp_path):
    """The current aepo (branching off) is unchanged: with branching on but no slot the run is bit-identical."""
    plain = record_run(make_tool_trainer(plugins=["aepo"], max_steps=1, output_dir=str(tmp_path / "p")))
    config = {"branching": True, "dynamic_rollouts": False, "initial_rollouts": 4}
    ours = record_run(make_tool_trainer(plugins=["aepo"], plugin_config={"aepo": config}, max_steps=1,
                                        output_dir=str(tmp_path / "b")))
    assert any(a.abs().sum() > 0 for a in plain.advantages)
    assert_runs_equal(plain, ours)


class SeeRows(Plugin):
    name = "test_aepo_rows"
    multi_turn = True
    seen: list = []

    @hookimpl
    def trl_plugins_after_generation(self, ctx):
        SeeRows.seen.append({i: (ctx.annotations[i].get(BRANCH_KEY), list(ctx.completion_ids[i]), ctx.episodes.get(i))
                             for i in range(len(ctx))})


@pytest.mark.slow
def test_pre_monitored_branches_fill_the_slots_on_the_tool_trainer(tmp_path):
    with temporary_plugin(SeeRows):
        SeeRows.seen = []
        tr = make_tool_trainer(plugins=["aepo", "test_aepo_rows"], max_steps=1, output_dir=str(tmp_path),
                               plugin_config={"aepo": {"branching": True, "branch_probability": 0.0,
                                                       "budget_scale": 0.0}})
        run = record_run(tr)
    (rows,) = SeeRows.seen
    filled = {i: v for i, v in rows.items() if v[0] is not None}
    assert filled, "no branch was made although every boundary branches"
    (log,) = [entry for entry in run.logs if "plugins/aepo/global_rollouts" in entry]
    # budget_scale 0: the pre-monitoring gives int(4 sigmoid(0)) + 1 = 3 global rollouts, one slot per group (the
    # tiny random model's segment entropies are near 20 log V / log V, so a scaled split would often leave none)
    assert log["plugins/aepo/global_rollouts"] == 3.0 and log["plugins/aepo/branches"] > 0
    for i, (tag, ids, episode) in filled.items():
        source, k = (int(x) for x in tag.split("@"))
        assert i % 4 == 3 and k >= 1 and source // 4 == i // 4 and source % 4 < 3  # a global rollout of its group
        assert episode is not None and ids == episode.completion_ids
        assert 0 in episode.tool_mask[: episode.start]  # the kept prefix ends with the source's tool result
    assert tr.state.global_step == 1

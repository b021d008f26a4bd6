"""SPO-chain: the official cut-point rule, segment advantages and whitening on small tensors, the advantage hook from
annotations, the neutral setting, the vLLM refusal, and a run on the tiny model through the branching seam."""

from types import SimpleNamespace

import pytest
import torch

from trl_plugins import IncompatiblePluginsError, PluginConfigError, build_plugins
from trl_plugins.testing import assert_reduces_to_vanilla, digit_fraction_reward, make_advantage_context, \
    make_tiny_trainer, record_run
from trl_plugins_builtin.spo import CUTS_KEY, LENGTH_KEY, LOW_KEY, SpoPlugin, cut_points, segment_advantages, \
    whiten_over

ALL = torch.ones(6, dtype=torch.bool)


def test_cut_points_follow_the_official_rule():
    probs = torch.tensor([0.5, 0.95, 0.3, 0.2, 0.99, 0.1, 0.4])  # below 0.9 at 0, 2, 3, 5, 6
    assert cut_points(probs, 0.9, 1) == [-1, 1, 2, 4, 5]  # the boundary just before each low-probability token
    assert cut_points(probs, 0.9, 2) == [-1, 2, 5]  # every 2nd candidate, the first one kept
    assert cut_points(probs, 0.9, 2, limit=2) == [-1, 2]
    assert cut_points(probs, 0.25, 1) == [2, 4]


def test_segment_advantages_by_hand():
    # cuts after tokens -1 (the prompt), 1 and 3; reward 0: segments [0, 1], [2, 3], [4, 5]
    adv = segment_advantages(6, [-1, 1, 3], [0.5, 0.25, 1.0], 0.0, ALL)
    torch.testing.assert_close(adv, torch.tensor([-0.25, -0.25, 0.75, 0.75, -1.0, -1.0]))
    # without the prompt's value the first segment has no start: 0
    adv = segment_advantages(6, [1, 3], [0.25, 1.0], 1.0, ALL)
    torch.testing.assert_close(adv, torch.tensor([0.0, 0.0, 0.75, 0.75, 0.0, 0.0]))
    # high-probability tokens get 0; a rollout without a cut point gets 0 everywhere
    low = torch.tensor([True, False, True, False, True, True])
    adv = segment_advantages(6, [-1, 1, 3], [0.5, 0.25, 1.0], 0.0, low)
    torch.testing.assert_close(adv, torch.tensor([-0.25, 0.0, 0.75, 0.0, -1.0, -1.0]))
    assert torch.equal(segment_advantages(6, [], [], 1.0, ALL), torch.zeros(6))


def test_whitening_over_the_trained_tokens_only():
    adv = torch.tensor([[1.0, 3.0, 100.0], [5.0, 0.0, 0.0]])
    mask = torch.tensor([[True, True, False], [True, False, False]])
    out = whiten_over(adv, mask)
    valid = torch.tensor([1.0, 3.0, 5.0])
    torch.testing.assert_close(out[mask], (valid - 3.0) / torch.sqrt(valid.var() + 1e-8))
    assert torch.equal(whiten_over(adv, torch.zeros_like(mask)), adv)


def _annotated(cuts, low, length=6):
    return {CUTS_KEY: cuts, LOW_KEY: low, LENGTH_KEY: length}


def test_advantage_hook_builds_token_advantages_from_the_annotations():
    notes = [_annotated([[-1, 0.5], [1, 0.25], [3, 1.0]], [0, 1, 2, 3, 4, 5]),
             _annotated([[-1, 0.5], [1, 0.25], [3, 1.0]], [0, 2, 4]),
             {"refill_round": 1}, _annotated([], [0, 1])]
    ctx = make_advantage_context(torch.tensor([0.0, 1.0, 1.0, 0.0]), num_generations=2, annotations=notes,
                                 completion_lengths=[6, 6, 6, 6])
    trl_advantages = ctx.advantages.clone()
    build_plugins(["spo"], {"spo": {"whiten": False}}).call("trl_plugins_transform_advantages", ctx)
    assert ctx.advantages.shape[0] == 4
    torch.testing.assert_close(ctx.advantages[0], torch.tensor([-0.25, -0.25, 0.75, 0.75, -1.0, -1.0]))
    torch.testing.assert_close(ctx.advantages[1], torch.tensor([-0.25, 0.0, 0.75, 0.0, 0.0, 0.0]))
    assert torch.all(ctx.advantages[2] == trl_advantages[2])  # no annotation: TRL's advantage
    assert torch.equal(ctx.advantages[3], torch.zeros(6))  # no cut point: 0 (official)
    mixed = make_advantage_context(torch.tensor([0.0, 1.0, 1.0, 0.0]), num_generations=2, annotations=notes,
                                   completion_lengths=[6, 6, 6, 6])
    build_plugins(["spo"], {"spo": {"whiten": False, "weight": 0.5}}).call("trl_plugins_transform_advantages", mixed)
    torch.testing.assert_close(mixed.advantages[0], 0.5 * trl_advantages[0] + 0.5 * ctx.advantages[0])


def test_neutral_weight_switches_every_hook_off():
    stack = build_plugins(["spo"], {"spo": {"weight": 0.0}})
    assert not stack.has("trl_plugins_after_generation") and not stack.has("trl_plugins_transform_advantages")


def test_bad_options_and_vllm_are_refused():
    for bad in ({"prob_threshold": 0.0}, {"mc_samples": 0}, {"cutpoint_interval": 0}, {"weight": 1.5}):
        with pytest.raises(PluginConfigError, match=next(iter(bad))):
            build_plugins(["spo"], {"spo": bad})
    plugin = SpoPlugin()
    with pytest.raises(IncompatiblePluginsError, match="use_vllm=False"):
        plugin.trl_plugins_configure(None, SimpleNamespace(use_vllm=True))


def test_neutral_setting_is_vanilla():
    assert_reduces_to_vanilla("spo", {"weight": 0.0}, loss_types=("grpo",))


def test_one_step_on_the_tiny_model_through_the_branching_seam(tmp_path):
    trainer = make_tiny_trainer(reward_funcs=[digit_fraction_reward], max_steps=1, plugins=["spo"],
                                plugin_config={"spo": {"mc_samples": 2, "max_cutpoints": 2}},
                                output_dir=str(tmp_path))
    run = record_run(trainer)
    logs = [log for log in run.logs if "plugins/spo/cutpoints" in log]
    assert logs and logs[0]["plugins/spo/cutpoints"] > 0  # the random tiny policy has low-probability tokens
    assert trainer.generation_service.total == logs[0]["plugins/spo/extra_rollouts"] > 0
    assert logs[0]["plugins/spo/trained_token_fraction"] > 0

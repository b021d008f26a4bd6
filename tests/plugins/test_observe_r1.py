"""observe_r1 (Observe-R1's official experience maker): the bonus for the shortest correct response above the length
constraint, the per-group weight 4 c p (1 - p) by hand; the reward and advantage hooks; the data ladder's sampler has
TRL's layout over the dataset's (or a column's) order; bad options refused; the neutral setting is vanilla TRL; a tiny
run trains on the ladder."""

import pytest
import torch
from trl.trainer.grpo_trainer import RepeatSampler

from trl_plugins import PluginConfigError, build_plugins
from trl_plugins.testing import (
    assert_reduces_to_vanilla,
    make_advantage_context,
    make_reward_context,
    make_tiny_trainer,
)
from trl_plugins_builtin.observe_r1 import LadderSampler, dynamic_weights, ladder_order, shortest_correct_bonus


def _plugin(**options):
    return build_plugins(["observe_r1"], {"observe_r1": options} if options else {}).plugins[0]


def test_bonus_goes_to_the_shortest_correct_response_above_the_constraint():
    lengths = torch.tensor([150, 120, 90, 200,   50, 80, 300, 400,   120, 130, 140, 150,   110, 110, 300, 10])
    correct = torch.tensor([1, 1, 0, 0,   1, 1, 0, 0,   0, 0, 0, 0,   1, 1, 1, 0], dtype=torch.bool)
    bonus = shortest_correct_bonus(lengths, correct, 4, 0.2, 100)
    assert torch.allclose(bonus.view(4, 4).float(), torch.tensor([
        [0.0, 0.2, 0.0, 0.0],  # the shorter correct one (the 90-token row is wrong)
        [0.0, 0.0, 0.0, 0.0],  # shortest correct has 50 tokens <= 100: no bonus
        [0.0, 0.0, 0.0, 0.0],  # no correct row: no bonus (official: row 0 would get it)
        [0.2, 0.0, 0.0, 0.0],  # tie: the first
    ]))
    assert shortest_correct_bonus(lengths, correct, 4, 0.2, 0)[4] == pytest.approx(0.2)


def test_dynamic_weight_peaks_at_half_correct():
    correct = torch.tensor([1, 1, 0, 0,  1, 0, 0, 0,  1, 1, 1, 1,  0, 0, 0, 0], dtype=torch.bool)
    assert dynamic_weights(correct, 4, 1.8).tolist() == pytest.approx([1.8, 4 * 1.8 * 0.25 * 0.75, 0.0, 0.0])


def test_reward_hook_fills_the_bonus_column():
    completions = ["a" * 120, "b" * 150, "c" * 101, "d" * 5]
    ctx = make_reward_context([[1.0, 0.0], [1.0, 0.0], [0.0, 0.0], [1.0, 0.0]], num_generations=2,
                              reward_func_names=["acc", "observe_r1"], completions=completions)
    ctx.set_active_plugin("observe_r1")
    _plugin().trl_plugins_transform_rewards(ctx)  # character tokens: lengths 120, 150, 101, 5
    assert ctx.rewards_per_func[:, 1].tolist() == pytest.approx([0.2, 0.0, 0.0, 0.0])
    assert ctx.rewards_per_func[:, 0].tolist() == [1.0, 1.0, 0.0, 1.0]
    assert ctx.metrics["plugins/observe_r1/bonus_fraction"] == pytest.approx([0.25])


def test_advantage_hook_weights_each_group():
    acc = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0, 0.0])
    ctx = make_advantage_context(acc, num_generations=4, rewards_per_func=acc.unsqueeze(1))
    before = ctx.advantages.clone()
    ctx.set_active_plugin("observe_r1")
    _plugin().trl_plugins_transform_advantages(ctx)
    w = torch.tensor([4 * 1.8 * 0.75 * 0.25, 4 * 1.8 * 0.25 * 0.75]).repeat_interleave(4)
    assert torch.allclose(ctx.advantages, before * w.to(before))
    assert ctx.metrics["plugins/observe_r1/dynamic_weight_mean"] == pytest.approx([float(w.mean())])


def test_ladder_sampler_has_trls_layout_without_shuffling():
    ours = LadderSampler(list(range(7)), mini_repeat_count=2, batch_size=3, repeat_count=2)
    trls = RepeatSampler(list(range(7)), mini_repeat_count=2, batch_size=3, repeat_count=2, shuffle=False)
    assert list(ours) == list(trls) and len(ours) == len(trls)
    dataset = {"level": [3, 1, 2, 1]}

    class Rows(dict):
        def __len__(self):
            return 4

    assert ladder_order(Rows(dataset), "level") == [1, 3, 2, 0]  # stable: the two level-1 prompts keep their order
    assert ladder_order(Rows(dataset), None) == [0, 1, 2, 3]


def test_bad_options_are_refused(tmp_path):
    with pytest.raises(PluginConfigError, match="'ladder_column' of plugin 'observe_r1' got 'level' with data_ladder"):
        _plugin(ladder_column="level", data_ladder=False)
    with pytest.raises(PluginConfigError, match="'diff_coef' of plugin 'observe_r1' got 0"):
        _plugin(diff_coef=0.0)
    with pytest.raises(PluginConfigError, match="'bonus_coef' of plugin 'observe_r1' got -0.1"):
        _plugin(bonus_coef=-0.1)
    with pytest.raises(PluginConfigError, match="difficulty"):
        make_tiny_trainer(plugins=["observe_r1"], plugin_config={"observe_r1": {"ladder_column": "difficulty"}},
                          output_dir=str(tmp_path))


def test_neutral_setting_reduces_to_vanilla():
    neutral = {"bonus_coef": 0.0, "dynamic_weighting": False, "data_ladder": False}
    runs = assert_reduces_to_vanilla("observe_r1", neutral, loss_types=("dapo", "grpo"), steps=1)
    assert any("plugins/observe_r1/bonus_fraction" in log for log in runs["dapo"].logs)


def test_tiny_run_trains_on_the_ladder(tmp_path):
    from trl_plugins.testing import digit_fraction_reward, tiny_dataset

    # the untrained model is never correct (every group would weigh 0): success on the dense partial-credit reward
    dataset = tiny_dataset(8, levels=(2, 1))
    options = {"ladder_column": "level", "bonus_constraint": 0, "success_threshold": 0.2}
    trainer = make_tiny_trainer(plugins=["observe_r1"], dataset=dataset, max_steps=1, output_dir=str(tmp_path),
                                reward_funcs=[digit_fraction_reward], plugin_config={"observe_r1": options})
    sampler = trainer.get_train_sampler(dataset)
    first = [dataset["level"][i] for i in list(sampler)[:: trainer.args.num_generations]]
    assert first == sorted(first)  # easy to hard
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    assert any(not torch.equal(before[n], p) for n, p in trainer.model.named_parameters())
    logs = {k: v for entry in trainer.state.log_history for k, v in entry.items()}
    assert logs["plugins/observe_r1/dynamic_weight_mean"] > 0

"""length_shaping mode PEAR (reconstructed bonus): the phase boundary is the first token after the marker; phase means
by hand; the bonus penalises thinking entropy (answer entropy only with its own weight) on correct rows; through the
reward hook the column holds the bonus computed from the context's policy entropies; zero weights skip the forward
and the run equals vanilla TRL apart from the all-zero column; a run trains."""

import pytest
import torch
from trl import GRPOTrainer

from trl_plugins import PluginConfigError, build_plugins
from trl_plugins.testing import CharTokenizer, char_encode, make_reward_context, make_tiny_trainer, record_run
from trl_plugins_builtin._pear import pear_bonus, phase_boundary, phase_entropies


def _decode(ids):
    return CharTokenizer().decode(ids)


def test_phase_boundary_is_the_first_token_after_the_marker():
    ids = char_encode("abc</think>xy")
    assert phase_boundary(ids, _decode, "</think>") == 11
    assert phase_boundary(char_encode("no marker here"), _decode, "</think>") == 14
    assert phase_boundary(char_encode("</think>"), _decode, "</think>") == 8


def test_phase_entropies_and_bonus():
    h = torch.tensor([1.0, 3.0, 0.5, 0.1])
    assert phase_entropies(h, 2) == (2.0, pytest.approx(0.3))
    assert phase_entropies(h, 4) == (pytest.approx(1.15), 0.0)
    think, answer = torch.tensor([2.0, 1.0, 2.0]), torch.tensor([0.5, 0.5, 0.5])
    correct = torch.tensor([True, True, False])
    bonus = pear_bonus(think, answer, correct, 0.1, 0.0)
    assert bonus.tolist() == pytest.approx([-0.2, -0.1, 0.0])
    assert pear_bonus(think, answer, correct, 0.1, 0.2).tolist() == pytest.approx([-0.3, -0.2, 0.0])
    assert pear_bonus(think, answer, correct, 0.1, 0.0, only_correct=False)[2] == pytest.approx(-0.2)


def test_reward_hook_fills_the_column_from_policy_entropies():
    completions = ["ab</think>7", "abcdef</think>7", "zz", "q</think>1"]
    calls = []

    def entropies(prompt_ids, completion_ids):
        calls.append(len(completion_ids))
        return [torch.arange(len(c), dtype=torch.float32) for c in completion_ids]  # entropy = position

    ctx = make_reward_context([[1.0, 0.0], [1.0, 0.0], [0.0, 0.0], [1.0, 0.0]], num_generations=2,
                              reward_func_names=["acc", "length_shaping"], completions=completions,
                              policy_entropies=entropies)
    ctx.set_active_plugin("length_shaping")
    plugin = build_plugins(["length_shaping"], {"length_shaping": {"mode": "pear", "pear_alpha": 0.5}}).plugins[0]
    plugin.trl_plugins_transform_rewards(ctx)
    assert calls == [4]
    # row 0: thinking = "ab</think>" (10 tokens, entropies 0..9, mean 4.5); row 1: 14 tokens, mean 6.5; row 2 wrong
    assert ctx.rewards_per_func[:, 1].tolist() == pytest.approx([-2.25, -3.25, 0.0, -2.0])
    assert ctx.rewards_per_func[:, 0].tolist() == [1.0, 1.0, 0.0, 1.0]
    assert "plugins/length_shaping/think_entropy" in ctx.metrics


def test_zero_weights_skip_the_forward():
    ctx = make_reward_context([[1.0, 0.0], [0.0, 0.0]], num_generations=2, reward_func_names=["acc", "length_shaping"],
                              completions=["a", "b"], policy_entropies=lambda p, c: pytest.fail("forward ran"))
    plugin = build_plugins(["length_shaping"], {"length_shaping": {"mode": "pear", "pear_alpha": 0.0}}).plugins[0]
    plugin.trl_plugins_transform_rewards(ctx)
    assert ctx.rewards_per_func[:, 1].tolist() == [0.0, 0.0]


def test_bad_options_are_refused():
    with pytest.raises(PluginConfigError, match="pear_alpha"):
        build_plugins(["length_shaping"], {"length_shaping": {"mode": "pear", "pear_alpha": -0.1}})
    with pytest.raises(PluginConfigError, match="mode"):
        build_plugins(["length_shaping"], {"length_shaping": {"mode": "peer"}})


RUN = dict(max_steps=2, num_generations=4, per_device_train_batch_size=8)


def test_neutral_weights_are_vanilla_and_a_run_trains(tmp_path):
    from trl_plugins.testing import digit_fraction_reward

    vanilla = record_run(make_tiny_trainer(GRPOTrainer, reward_funcs=[digit_fraction_reward],
                                           output_dir=str(tmp_path / "v"), **RUN))
    neutral = record_run(make_tiny_trainer(
        reward_funcs=[digit_fraction_reward], plugins=["length_shaping"],
        plugin_config={"length_shaping": {"mode": "pear", "pear_alpha": 0.0, "correct_threshold": 0.2}},
        output_dir=str(tmp_path / "n"), **RUN))
    for x, y in zip(vanilla.rewards, neutral.rewards):
        torch.testing.assert_close(x, y[:, :1], rtol=0, atol=0)
        assert torch.equal(y[:, 1], torch.zeros_like(y[:, 1]))
    for x, y in zip(vanilla.advantages, neutral.advantages):
        torch.testing.assert_close(x, y, rtol=0, atol=0)
    for key in vanilla.params:
        torch.testing.assert_close(vanilla.params[key], neutral.params[key], rtol=0, atol=0)
    acting = record_run(make_tiny_trainer(
        reward_funcs=[digit_fraction_reward], plugins=["length_shaping"],
        plugin_config={"length_shaping": {"mode": "pear", "pear_alpha": 0.5, "correct_threshold": 0.2,
                                          "pear_only_correct": False}},
        output_dir=str(tmp_path / "a"), **RUN))
    assert any(float(r[:, 1].abs().sum()) > 0 for r in acting.rewards)
    logs = [log for log in acting.logs if "loss" in log]
    assert logs and all(log["plugins/length_shaping/think_entropy"] > 0 for log in logs)

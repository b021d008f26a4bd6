"""pear (PEAR, reconstructed bonus): the phase boundary is the first token after the marker; phase means
by hand; the bonus penalises thinking entropy (answer entropy only with its own weight) on correct rows; through the
reward hook the column holds the bonus computed from the context's policy entropies; zero weights skip the forward
and the run equals vanilla TRL apart from the all-zero column; a run trains."""

import pytest
import torch

from trl_plugins import PluginConfigError, build_plugins
from trl_plugins.testing import (
    CharTokenizer,
    assert_reduces_to_vanilla,
    char_encode,
    make_reward_context,
    make_tiny_trainer,
    record_run,
)
from trl_plugins_builtin._phases import phase_boundary
from trl_plugins_builtin.pear import pear_bonus, phase_entropies


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
                              reward_func_names=["acc", "pear"], completions=completions,
                              policy_entropies=entropies)
    ctx.set_active_plugin("pear")
    plugin = build_plugins(["pear"], {"pear": {"alpha": 0.5}}).plugins[0]
    plugin.trl_plugins_transform_rewards(ctx)
    assert calls == [4]
    # row 0: thinking = "ab</think>" (10 tokens, entropies 0..9, mean 4.5); row 1: 14 tokens, mean 6.5; row 2 wrong
    assert ctx.rewards_per_func[:, 1].tolist() == pytest.approx([-2.25, -3.25, 0.0, -2.0])
    assert ctx.rewards_per_func[:, 0].tolist() == [1.0, 1.0, 0.0, 1.0]
    assert "plugins/pear/think_entropy" in ctx.metrics


def test_zero_weights_skip_the_forward():
    ctx = make_reward_context([[1.0, 0.0], [0.0, 0.0]], num_generations=2, reward_func_names=["acc", "pear"],
                              completions=["a", "b"], policy_entropies=lambda p, c: pytest.fail("forward ran"))
    plugin = build_plugins(["pear"], {"pear": {"alpha": 0.0}}).plugins[0]
    plugin.trl_plugins_transform_rewards(ctx)
    assert ctx.rewards_per_func[:, 1].tolist() == [0.0, 0.0]


def test_bad_options_are_refused():
    with pytest.raises(PluginConfigError, match="'alpha' of plugin 'pear' got -0.1"):
        build_plugins(["pear"], {"pear": {"alpha": -0.1}})
    with pytest.raises(PluginConfigError, match="'answer_alpha' of plugin 'pear' got nan"):
        build_plugins(["pear"], {"pear": {"answer_alpha": float("nan")}})
    with pytest.raises(PluginConfigError, match="Unknown option 'pear_alpha' for plugin 'pear'. Did you mean .*'alpha'"):
        build_plugins(["pear"], {"pear": {"pear_alpha": 0.1}})


RUN = dict(steps=2, num_generations=4, per_device_train_batch_size=8)


def test_neutral_weights_reduce_to_vanilla():
    assert_reduces_to_vanilla("pear", {"alpha": 0.0, "correct_threshold": 0.2}, loss_types=("dapo",), **RUN)


def test_a_run_with_the_bonus_trains(tmp_path):
    from trl_plugins.testing import digit_fraction_reward

    acting = record_run(make_tiny_trainer(
        reward_funcs=[digit_fraction_reward], plugins=["pear"],
        plugin_config={"pear": {"alpha": 0.5, "correct_threshold": 0.2, "only_correct": False}},
        output_dir=str(tmp_path / "a"), max_steps=2, num_generations=4, per_device_train_batch_size=8))
    assert any(float(r[:, 1].abs().sum()) > 0 for r in acting.rewards)
    logs = [log for log in acting.logs if "loss" in log]
    assert logs and all(log["plugins/pear/think_entropy"] > 0 for log in logs)

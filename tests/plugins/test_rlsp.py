"""rlsp (RLSP's decoupled exploration reward): the reasoning length before the boxed answer, -c / L and the
missing-answer penalty by hand (the official server's numbers); the reward hook fills only its own column and logs
the lengths; two processes agree; bad options are refused; the neutral setting is vanilla TRL; a tiny run trains."""

import re

import pytest
import torch

from trl_plugins import PluginConfigError, build_plugins
from trl_plugins.testing import assert_reduces_to_vanilla, make_reward_context, make_tiny_trainer, run_on_processes
from trl_plugins_builtin.rlsp import BOXED, exploration_reward, reasoning_length

PATTERN = re.compile(BOXED)


def _plugin(**options):
    plugin = build_plugins(["rlsp"], {"rlsp": options} if options else {}).plugins[0]
    return plugin


def test_reasoning_is_the_text_before_the_boxed_answer():
    text = "a" * 40 + r"\boxed{\frac{1}{2}} done"
    assert reasoning_length(text, PATTERN, 4.0) == (10.0, True)  # 40 characters / 4
    assert reasoning_length("b" * 20, PATTERN, 4.0) == (5.0, False)  # no answer: the whole response
    assert reasoning_length(r"\boxed{3}", PATTERN, 4.0) == (1.0, True)  # empty reasoning: floored at one token
    assert reasoning_length("x" * 9 + "Answer: 3", re.compile("Answer:"), 3.0) == (3.0, True)


def test_exploration_reward_is_minus_c_over_length_plus_the_format_penalty():
    # the official server: 1 - 1000 / 250 for a correct 1000-character reasoning; -0.5 - 1000 / 10 without an answer
    values = exploration_reward([250.0, 10.0, 500.0], [True, False, True], 1000.0, -0.5)
    assert values == pytest.approx([-4.0, -100.5, -2.0])
    assert values[2] > values[0]  # longer reasoning, smaller penalty
    assert exploration_reward([250.0, 10.0], [True, False], 0.0, 0.0) == [0.0, 0.0]


def test_reward_hook_fills_only_its_column_and_logs():
    completions = ["a" * 40 + r"\boxed{1}", "a" * 8 + r"\boxed{2}", "no answer here!!", [{"role": "assistant",
                   "content": "c" * 80 + r"\boxed{4}"}]]
    ctx = make_reward_context([[1.0, 0.0], [0.0, 0.0], [0.0, 0.0], [1.0, 0.0]], num_generations=2,
                              reward_func_names=["acc", "rlsp"], completions=completions)
    ctx.set_active_plugin("rlsp")
    _plugin(length_penalty=10.0).trl_plugins_transform_rewards(ctx)
    assert ctx.rewards_per_func[:, 0].tolist() == [1.0, 0.0, 0.0, 1.0]  # the outcome column is untouched
    assert ctx.rewards_per_func[:, 1].tolist() == pytest.approx([-1.0, -5.0, -0.5 - 2.5, -0.5])
    assert ctx.metrics["plugins/rlsp/reasoning_tokens"] == pytest.approx([(10 + 2 + 4 + 20) / 4])
    assert ctx.metrics["plugins/rlsp/answered_fraction"] == pytest.approx([0.75])


def test_two_processes_fill_the_same_column():
    completions = ["a" * 40 + r"\boxed{1}", "short", "a" * 4 + r"\boxed{2}", "b" * 12]

    def run(rank, gather):
        ctx = make_reward_context([[1.0, 0.0]] * 4, num_generations=2, reward_func_names=["acc", "rlsp"],
                                  completions=completions, num_processes=2, process_index=rank, gather=gather)
        ctx.set_active_plugin("rlsp")
        _plugin().trl_plugins_transform_rewards(ctx)
        return ctx.rewards_per_func[:, 1].tolist()

    first, second = run_on_processes(2, run)
    assert first == second
    assert first == pytest.approx([-100.0, -0.5 - 1000 / 1.25, -1000.0, -0.5 - 1000 / 3])


def test_bad_options_are_refused():
    with pytest.raises(PluginConfigError, match="'length_penalty' of plugin 'rlsp' got -1"):
        _plugin(length_penalty=-1.0)
    with pytest.raises(PluginConfigError, match="'missing_answer_reward' of plugin 'rlsp' got 0.5"):
        _plugin(missing_answer_reward=0.5)
    with pytest.raises(PluginConfigError, match=r"'answer_pattern' of plugin 'rlsp' got '\\\\boxed\{\('.*regular"):
        _plugin(answer_pattern="\\boxed{(")
    with pytest.raises(PluginConfigError, match="'chars_per_token' of plugin 'rlsp' got 0"):
        _plugin(chars_per_token=0.0)


def test_neutral_setting_reduces_to_vanilla():
    runs = assert_reduces_to_vanilla("rlsp", {"length_penalty": 0.0, "missing_answer_reward": 0.0},
                                     loss_types=("dapo", "grpo"), steps=1)
    assert any("plugins/rlsp/reasoning_tokens" in log for log in runs["dapo"].logs)


def test_tiny_run_trains_with_the_exploration_column(tmp_path):
    trainer = make_tiny_trainer(plugins=["rlsp"], plugin_config={"rlsp": {"answer_pattern": "Answer:",
                                                                          "length_penalty": 10.0}},
                                max_steps=1, output_dir=str(tmp_path))
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    assert any(not torch.equal(before[n], p) for n, p in trainer.model.named_parameters())
    logs = {k: v for entry in trainer.state.log_history for k, v in entry.items()}
    assert logs["plugins/rlsp/reasoning_tokens"] > 0 and logs["rewards/rlsp/mean"] < 0

"""Bad data: NaN / inf rewards (the reward guard), empty completions, over-long prompts, empty rubric lists, missing
reference solutions and missing dataset columns -- each is a clear error naming the row and the column / function,
or documented handling (docs/reliability.md)."""

from __future__ import annotations

import asyncio
import functools
import math

import pytest
import torch
from datasets import Dataset

from trl_plugins import PluginConfigError, PluginError
from trl_plugins.api.collectives import CAUSE_BYTES, HeldRewardErrors
from trl_plugins.guards.rewards_guard import (
    RewardValueError,
    check_reward_values,
    guard_reward_funcs,
    is_guarded,
)
from trl_plugins.tasks.arithmetic import accuracy_reward
from trl_plugins.testing import digit_fraction_reward, make_tiny_trainer, tiny_dataset

# ============================================================================================ NaN / inf rewards


def _poisoned(value, row=1, name="poisoned_reward"):
    def reward(completions, **kwargs):
        return [value if i == row else 0.5 for i in range(len(completions))]

    reward.__name__ = name
    return reward


@pytest.mark.parametrize("value,shown", [(float("nan"), "nan"), (float("inf"), "inf"), (-math.inf, "-inf"),
                                         ("0.7?", "'0.7?' (str), which is not a number")])
def test_nan_or_inf_reward_is_an_error_naming_function_row_and_value(value, shown, tmp_path):
    trainer = make_tiny_trainer(reward_funcs=[accuracy_reward, _poisoned(value)], output_dir=str(tmp_path),
                                max_steps=1, log_level="error")
    with pytest.raises(RewardValueError) as err:
        trainer.train()
    message = str(err.value)
    assert f"Reward function 'poisoned_reward' returned {shown} for row 1 of the 4 rows" in message, message
    assert "prompt 'Compute " in message and "completion '" in message
    assert "return None" in message
    assert trainer.state.global_step == 0


def test_none_stays_allowed_as_unscorable(tmp_path):
    def sometimes_none(completions, **kwargs):
        return [None if i % 2 else 1.0 for i in range(len(completions))]

    trainer = make_tiny_trainer(reward_funcs=[digit_fraction_reward, sometimes_none], output_dir=str(tmp_path),
                                max_steps=1, log_level="error")
    seen = []
    original = trainer._calculate_rewards
    trainer._calculate_rewards = lambda *a: seen.append(original(*a)) or seen[-1]
    trainer.train()
    column = seen[0][:, 1]
    assert torch.isnan(column[1::2]).all() and (column[0::2] == 1.0).all()
    assert trainer.state.global_step == 1


def test_async_reward_functions_are_guarded_too(tmp_path):
    async def async_judge(completions, **kwargs):
        await asyncio.sleep(0)
        return [float("nan")] * len(completions)

    trainer = make_tiny_trainer(reward_funcs=[async_judge], output_dir=str(tmp_path), max_steps=1, log_level="error")
    assert trainer.reward_func_names == ["async_judge"]
    with pytest.raises(RewardValueError, match=r"'async_judge' returned nan for row 0"):
        trainer.train()


def test_guard_keeps_names_weights_and_kinds():
    from trl.trainer.utils import get_callable_name, is_async_callable

    class Scorer:
        def __call__(self, completions, **kwargs):
            return [1.0] * len(completions)

    async def judge(completions, **kwargs):
        return [1.0] * len(completions)

    def weighted(completions, **kwargs):
        return [1.0] * len(completions)

    weighted.reward_weight = 0.25
    partial = functools.partial(lambda completions, scale, **kw: [scale] * len(completions), scale=2.0)
    funcs = [accuracy_reward, Scorer(), judge, weighted, partial, "some/reward-model"]
    guarded = guard_reward_funcs(list(funcs))
    assert [get_callable_name(f) for f in guarded[:5]] == [get_callable_name(f) for f in funcs[:5]]
    assert [get_callable_name(f) for f in guarded[:5]] == ["accuracy_reward", "Scorer", "judge", "weighted", "<lambda>"]
    assert [is_async_callable(f) for f in guarded[:5]] == [False, False, True, False, False]
    assert guarded[3].reward_weight == 0.25
    assert guarded[5] == "some/reward-model"  # model ids and nn.Modules are left to TRL
    assert guard_reward_funcs(guarded) == guarded and all(is_guarded(f) for f in guarded[:5])  # idempotent
    assert guarded[4](completions=["a", "b"]) == [2.0, 2.0]
    assert asyncio.run(guarded[2](completions=["a"])) == [1.0]
    assert guard_reward_funcs(accuracy_reward).__name__ == "accuracy_reward" and guard_reward_funcs(None) is None


def test_wrong_number_of_rewards_is_refused_naming_the_function(tmp_path):
    def one_short(completions, **kwargs):
        return [1.0] * (len(completions) - 1)

    trainer = make_tiny_trainer(reward_funcs=[one_short], output_dir=str(tmp_path), max_steps=1, log_level="error")
    with pytest.raises(RewardValueError, match=r"'one_short' returned 3 rewards for 4 completions"):
        trainer.train()


def test_held_errors_become_placeholder_zeros_until_taken():
    async def async_nan(completions, **kwargs):
        return [float("nan")] * len(completions)

    calls = []

    def counted(completions, **kwargs):
        calls.append(len(completions))
        return [1.0] * len(completions)

    held = HeldRewardErrors()
    sync, asynchronous, later = guard_reward_funcs([_poisoned(float("nan")), async_nan, counted], held)
    batch = {"prompts": ["p"] * 3, "completions": ["c"] * 3}
    with pytest.raises(RewardValueError, match="poisoned_reward"):  # not holding: raised at once
        sync(**batch)
    held.holding = True
    assert asyncio.run(asynchronous(**batch)) == [0.0, 0.0, 0.0]
    assert sync(**batch) == [0.0, 0.0, 0.0]  # skipped: an error is held already
    assert later(**batch) == [0.0, 0.0, 0.0] and calls == []  # no more reward work once the step is lost
    first = held.take()
    assert isinstance(first, RewardValueError) and "'async_nan' returned nan for row 0" in str(first)
    assert held.take() is None  # taken: forgotten
    assert later(**batch) == [1.0, 1.0, 1.0] and calls == [3]
    other = HeldRewardErrors()  # guarded again (another trainer): same function, that trainer's holder
    again = guard_reward_funcs([sync], other)[0]
    assert again.__wrapped__ is sync.__wrapped__ and again._held is other and is_guarded(again)


class _AsProcessZeroOfTwo:
    """The trainer's accelerator, seen as process 0 of 2: the other process's failure flag is given; the flags this
    process sends are recorded."""

    num_processes, process_index = 2, 0

    def __init__(self, real, other_failed: bool):
        self.real, self.other_failed, self.sent = real, other_failed, []

    def __getattr__(self, name):
        return getattr(self.real, name)

    def gather(self, tensor):
        self.sent.append(tensor.tolist())
        if tensor.numel() == CAUSE_BYTES + 1:  # after a set flag: the failing process's error, as bytes
            other = torch.zeros_like(tensor)
            if self.other_failed:
                text = b"RewardValueError: 'judge' returned nan for row 0"
                other[0] = len(text)
                other[1 : len(text) + 1] = torch.tensor(list(text))
            return torch.cat([tensor, other])
        return torch.cat([tensor, torch.tensor([int(self.other_failed)], dtype=tensor.dtype)])


@pytest.mark.parametrize("local_fails,other_fails", [(True, False), (False, True), (False, False)])
def test_reward_failure_on_one_process_stops_every_process_after_the_gather(local_fails, other_fails, tmp_path):
    """With several processes a reward function's error is raised only once TRL's reward gather has completed, on
    every process together: the failing one raises its own error, the others a PluginError naming it."""
    rows = [dict(r) for r in tiny_dataset(4)]
    prompts = [r["prompt"] for r in rows]
    completions = [[{"role": "assistant", "content": "Answer: 1"}]] * 4
    ids = [[1, 2]] * 4
    funcs = [digit_fraction_reward, _poisoned(float("nan")) if local_fails else digit_fraction_reward]
    trainer = make_tiny_trainer(reward_funcs=funcs, output_dir=str(tmp_path), log_level="error")
    expected = trainer._calculate_rewards(rows, prompts, completions, ids) if not local_fails else None
    trainer.accelerator = accelerator = _AsProcessZeroOfTwo(trainer.accelerator, other_fails)
    if local_fails:
        with pytest.raises(RewardValueError, match="'poisoned_reward' returned nan for row 1"):
            trainer._calculate_rewards(rows, prompts, completions, ids)
    elif other_fails:
        with pytest.raises(PluginError, match="reward functions: process 1 failed with RewardValueError: 'judge' "
                                              "returned nan for row 0; every process stops with it"):
            trainer._calculate_rewards(rows, prompts, completions, ids)
    else:
        torch.testing.assert_close(trainer._calculate_rewards(rows, prompts, completions, ids), expected)
    assert accelerator.sent[0] == [int(local_fails)]  # the flag went out: the other process is not left waiting
    # a set flag: one more collective carries the failing process's error (entered by both, nothing else)
    assert len(accelerator.sent) == (2 if local_fails or other_fails else 1)
    assert not trainer.held_reward_errors.holding


def test_trainer_keeps_reward_names_and_plugin_weights(tmp_path):
    trainer = make_tiny_trainer(
        plugins=["ruscarl"], plugin_config={"ruscarl": {"judge": "rule", "reward_weight": 0.5, "scaffold": False}},
        reward_funcs=[accuracy_reward, digit_fraction_reward], output_dir=str(tmp_path), log_level="error",
    )
    assert trainer.reward_func_names == ["accuracy_reward", "digit_fraction_reward", "ruscarl_rubric"]
    assert trainer.reward_weights.tolist() == [1.0, 1.0, 0.5]
    assert all(is_guarded(f) for f in trainer.reward_funcs)


def test_check_reward_values_accepts_numbers_of_every_kind():
    import numpy as np

    check_reward_values("r", [1, 0.5, True, np.float32(0.25), torch.tensor(0.5), None])
    with pytest.raises(RewardValueError, match="returned None instead of a list"):
        check_reward_values("r", None)
    with pytest.raises(RewardValueError, match=r"returned nan for row 2"):
        check_reward_values("r", [0.0, 1.0, np.float64("nan")])


def test_nan_reward_inside_a_sampling_plugin_scoring_is_the_same_error(tmp_path):
    """hint_scaffold scores candidates through ctx.score before TRL's own reward pass: same guard, same message."""
    trainer = make_tiny_trainer(
        plugins=["hint_scaffold"], plugin_config={"hint_scaffold": {"success_threshold": 0.9}},
        reward_funcs=[_poisoned(float("nan"), row=2)], output_dir=str(tmp_path), max_steps=1, log_level="error",
    )
    with pytest.raises(RewardValueError, match=r"'poisoned_reward' returned nan for row 2"):
        trainer.train()


# ============================================================================================ empty completions


def _backend_with_empty_rows(trainer):
    """Even rows: only EOS (an empty answer); odd rows: a short digit string."""
    tok = trainer.processing_class

    def single_turn(prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        out = []
        for j in range(len(prompt_ids)):
            text = "" if j % 2 == 0 else f"{j}{j}x"
            out.append(tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id])
        return out, None

    return single_turn


@pytest.mark.slow
def test_empty_completions_train_with_a_full_stack(tmp_path):
    trainer = make_tiny_trainer(
        plugins=["hint_scaffold", "canon", "lp_reg"],
        plugin_config={"hint_scaffold": {"success_threshold": 0.9}, "lp_reg": {"kappa": 0.45, "rho": 0.5}},
        reward_funcs=[accuracy_reward, digit_fraction_reward], output_dir=str(tmp_path), max_steps=2,
        log_level="error", loss_type="dr_grpo",
    )
    trainer._generate_single_turn = _backend_with_empty_rows(trainer)
    trainer.train()
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses)
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())


def test_a_plugin_cannot_leave_a_row_without_tokens():
    """TRL cannot pad or score a zero-token row (it fails later with an unrelated dtype error): refused at once."""
    from trl_plugins import PluginError
    from trl_plugins.testing import make_rollout_context

    ctx = make_rollout_context([["12", "34"]])
    with pytest.raises(PluginError, match=r"replace_row\(0\): the new completion has no tokens.*eos_token_id"):
        ctx.replace_row(0, [])
    with pytest.raises(PluginError, match=r"replace_row\(1\): the new completion has no tokens"):
        ctx.splice(1, 0, [])
    assert all(ctx.completion_ids), "a refused edit changes nothing"


# ============================================================================================ prompts over the limit


@pytest.mark.slow
def test_prompt_longer_than_the_model_context_is_not_truncated(tmp_path):
    """Documented handling: TRL 1.16 has no max_prompt_length and truncates nothing; neither does trl-plugins (a
    truncated prompt would silently change the task). Filter over-long prompts out of the dataset (docs/reliability.md);
    with vLLM the server refuses them (max_model_len), with HF generate a RoPE model runs past its trained context."""
    data = tiny_dataset(4).to_list()
    long_text = "Compute 1+1 step by step. " + "x" * 600  # the tiny model's context is 512 positions
    data[0]["prompt"] = [{"role": "user", "content": long_text}]
    trainer = make_tiny_trainer(
        plugins=["hint_scaffold"], plugin_config={"hint_scaffold": {"success_threshold": 0.9}},
        reward_funcs=[digit_fraction_reward], dataset=Dataset.from_list(data), output_dir=str(tmp_path),
        max_steps=1, log_level="error", per_device_train_batch_size=16, num_generations=4, max_completion_length=6,
    )
    lengths = []
    original = trainer._generate_and_score_completions
    trainer._generate_and_score_completions = lambda rows: (
        lambda out: lengths.append(out["prompt_mask"].sum(-1).max().item()) or out
    )(original(rows))
    trainer.train()
    assert trainer.model.config.max_position_embeddings == 512 and lengths[0] > 600


# ============================================================================================ plugin data columns


def test_reward_function_needing_a_missing_column_is_refused_at_construction(tmp_path):
    data = Dataset.from_list([{k: v for k, v in row.items() if k != "answer"} for row in tiny_dataset(4)])
    with pytest.raises(PluginConfigError) as err:
        make_tiny_trainer(reward_funcs=[accuracy_reward], dataset=data, output_dir=str(tmp_path))
    message = str(err.value)
    assert "'accuracy_reward'" in message and "'answer'" in message and "columns: prompt" in message


@pytest.mark.parametrize(
    "plugin,options,column",
    [
        ("ruscarl", {"judge": "rule"}, "rubrics"),
        ("ruscarl", {"judge": "rule", "rubrics_column": "my_rubrics"}, "my_rubrics"),
        ("scope", {"mode": "reference_suffix", "prm": "programmatic"}, "solution"),
        ("scope", {"mode": "reference_suffix", "prm": "programmatic"}, "problem"),
    ],
)
def test_missing_plugin_column_is_refused_at_construction(plugin, options, column, tmp_path):
    data = Dataset.from_list([{k: v for k, v in row.items() if k != column} for row in tiny_dataset(4)])
    with pytest.raises(PluginConfigError) as err:
        make_tiny_trainer(plugins=[plugin], plugin_config={plugin: options}, dataset=data, output_dir=str(tmp_path))
    assert f"'{plugin}'" in str(err.value) and f"'{column}'" in str(err.value)


def test_empty_rubric_list_is_refused_at_construction_or_skipped(tmp_path):
    """Documented handling: a dataset row without rubric items is refused before training starts (default); with
    empty_rubrics='skip' its rubric reward is None (unscored, not 0.0) and its generation prompt is untouched."""
    from trl_plugins.testing import build_stack, make_prompt_context

    rows = tiny_dataset(2).to_list()
    rows[1]["rubrics"] = []
    with pytest.raises(PluginConfigError, match=r"1 of 2 rows have no rubric items in column 'rubrics' \(first: row 1\)"):
        make_tiny_trainer(plugins=["ruscarl"], plugin_config={"ruscarl": {"judge": "rule"}},
                          dataset=Dataset.from_list(rows), reward_funcs=[digit_fraction_reward],
                          output_dir=str(tmp_path), log_level="error")
    stack = build_stack("ruscarl", {"ruscarl": {"judge": "rule", "empty_rubrics": "skip"}})
    plugin = stack.by_name["ruscarl"]
    columns = {k: [r[k] for r in rows] for k in rows[0] if k != "prompt"}
    completions = ["Answer: 1", rows[1]["solution"]]
    scores = plugin.score([r["prompt"] for r in rows], completions, columns)
    assert scores[0] is not None and scores[1] is None
    ctx = make_prompt_context([rows[1]] * 2, num_generations=2)
    stack.call("trl_plugins_generation_prompts", ctx)
    assert ctx.generation_prompts == ctx.prompts and ctx.annotations[0]["rubric_items"] == 0


@pytest.mark.parametrize("solution", ["", None])
def test_hint_scaffold_row_without_reference_solution_names_row_and_column(solution, tmp_path):
    data = tiny_dataset(4).to_list()
    for row in data:
        row["solution"] = solution if row is data[1] else row["solution"]
    trainer = make_tiny_trainer(
        plugins=["hint_scaffold"], plugin_config={"hint_scaffold": {"success_threshold": 0.9}},
        dataset=Dataset.from_list(data), reward_funcs=[digit_fraction_reward], output_dir=str(tmp_path),
        max_steps=2, log_level="error", per_device_train_batch_size=16, num_generations=4,
    )
    with pytest.raises(PluginConfigError, match=r"hint_scaffold: row \d+ has no reference solution in column "
                                                r"'solution'"):
        trainer.train()


def test_scope_reference_without_solution_names_the_column(tmp_path):
    data = tiny_dataset(4).to_list()
    for row in data:
        row["solution"] = ""
    trainer = make_tiny_trainer(
        plugins=["scope"],
        plugin_config={"scope": {"mode": "reference_suffix", "prm": "programmatic", "min_prefix_steps": 0,
                                 "accept": "any"}},
        dataset=Dataset.from_list(data), reward_funcs=[digit_fraction_reward], output_dir=str(tmp_path),
        max_steps=1, log_level="error",
    )
    with pytest.raises(PluginConfigError, match=r"no reference solution in column 'solution'"):
        trainer.train()


def test_a_numeric_string_reward_is_refused_by_the_guard_not_by_trls_tensor():
    with pytest.raises(RewardValueError, match=r"returned '0.5' \(str\), which is not a number for row 1"):
        check_reward_values("r", [1.0, "0.5"])


def test_a_reward_function_returning_a_generator_trains_as_with_plain_trl(tmp_path):
    def generated(completions, **kwargs):
        return (0.25 * (i % 2) for i in range(len(completions)))

    trainer = make_tiny_trainer(reward_funcs=[generated], output_dir=str(tmp_path), max_steps=1, log_level="error")
    seen = []
    original = trainer._calculate_rewards
    trainer._calculate_rewards = lambda *a: seen.append(original(*a)) or seen[-1]
    trainer.train()
    assert seen[0][:, 0].tolist() == [0.0, 0.25, 0.0, 0.25] and trainer.state.global_step == 1

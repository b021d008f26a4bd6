"""The success rule inside the real trainer: the scorer behind ``RolloutContext.reward_columns`` returns every reward
column (NaN for a placeholder column, which it does not run), ``score`` is TRL's weighted nansum of it, ``success``
reads the verifier column only; a success_column the run does not have is refused at construction."""

import pytest
import torch

from trl_plugins import Plugin, PluginConfigError, RolloutContext, hookimpl
from trl_plugins.api.success import mark_placeholder
from trl_plugins.testing import (
    digit_fraction_reward,
    make_tiny_trainer,
    temporary_plugin,
)


def half(completions, **kwargs):
    """Partial credit for every completion."""
    return [0.5] * len(completions)


def filled_later(completions, **kwargs):
    """A placeholder column: zeros at TRL's reward pass (a plugin would fill it at the reward stage)."""
    return [0.0] * len(completions)


class Recorder(Plugin):
    name = "success_recorder"
    paper = "Test plugin, arXiv:0000.00000"
    summary = "Records what the sampling-stage scorer returns."
    seen: list = []

    @hookimpl
    def trl_plugins_after_generation(self, ctx: RolloutContext):
        rows = range(len(ctx))
        Recorder.seen.append((ctx.reward_columns(rows), ctx.score(rows), ctx.success(rows)))


def test_trainer_scorer_returns_every_column_and_success_reads_the_verifier(tmp_path):
    Recorder.seen = []
    with temporary_plugin(Recorder):
        trainer = make_tiny_trainer(
            plugins=["success_recorder"], output_dir=str(tmp_path), max_steps=1, bf16=False,
            reward_funcs=[digit_fraction_reward, half, mark_placeholder(filled_later)], reward_weights=[1.0, 0.5, 2.0],
        )
        trainer.train()
    columns, score, success = Recorder.seen[0]
    assert columns.names == ["digit_fraction_reward", "half", "filled_later"]
    assert columns.placeholders == (False, False, True)
    # NaN, not the function's 0.0: the scorer does not run a placeholder column
    assert torch.isnan(columns.values[:, 2]).all() and (columns.values[:, 1] == 0.5).all()
    torch.testing.assert_close(score, columns.values[:, 0] + 0.25)  # weighted nansum: the placeholder adds nothing
    assert success.tolist() == (columns.values[:, 0] > 0).tolist()  # the verifier only: 'half' never counts


def test_unknown_success_column_is_refused_at_construction(tmp_path):
    with pytest.raises(PluginConfigError, match=r"Plugin 'hint_scaffold': success_column='accuracy' is not a reward"):
        make_tiny_trainer(plugins=["hint_scaffold"], plugin_config={"hint_scaffold": {"success_column": "accuracy"}},
                          output_dir=str(tmp_path), reward_funcs=[digit_fraction_reward])

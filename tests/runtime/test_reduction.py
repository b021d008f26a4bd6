"""Reduction (no plugins: exactly TRL) and the neutral setting of the loss path.

With no plugins, ``PluginGRPOTrainer`` must be identical to ``trl.GRPOTrainer`` with the same seed:
completions, rewards, advantages, per-micro-step losses, gradients and final parameters. The other tests run
the plugin loss path (used whenever a stack has loss or sampling hooks) with a plugin that contributes
nothing, which must also reproduce TRL exactly: for every loss type TRL offers, at both importance-sampling
levels, and with TRL's loss options.
"""

import pytest
from trl import GRPOTrainer

from trl_plugins import Plugin, hookimpl
from trl_plugins.api.loss_types import LOSS_TYPES as ALL_LOSS_TYPES
from trl_plugins.tasks.tiny import build_and_save
from trl_plugins.testing import (
    assert_runs_equal, digit_fraction_reward, make_tiny_trainer, make_tool_trainer, record_run,
)

LOSS_TYPES = ["grpo", "bnpo", "dr_grpo", "dapo"]
RUN = dict(reward_funcs=[digit_fraction_reward], max_steps=3, log_level="error")


class NeutralLossPlugin(Plugin):
    """Implements both loss hooks and changes nothing."""

    name = "neutral_loss"
    multi_turn = True

    @hookimpl
    def trl_plugins_loss_advantages(self, ctx):
        pass

    @hookimpl
    def trl_plugins_loss(self, ctx):
        pass


@pytest.fixture(scope="module")
def vanilla_runs():
    return {lt: record_run(make_tiny_trainer(GRPOTrainer, loss_type=lt, **RUN)) for lt in LOSS_TYPES}


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_no_plugins_is_identical_to_trl(loss_type, vanilla_runs):
    vanilla = vanilla_runs[loss_type]
    ours = record_run(make_tiny_trainer(loss_type=loss_type, **RUN))
    # the comparison is not vacuous: the runs have signal
    assert any(adv.abs().sum() > 0 for adv in vanilla.advantages)
    assert any(g.abs().sum() > 0 for grads in vanilla.grads for g in grads.values())
    assert_runs_equal(vanilla, ours)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_plugin_loss_path_with_neutral_plugin_is_identical(loss_type, vanilla_runs, temporary_plugin):
    temporary_plugin(NeutralLossPlugin)
    trainer = make_tiny_trainer(loss_type=loss_type, plugins=["neutral_loss"], **RUN)
    assert trainer._uses_plugin_loss
    assert_runs_equal(vanilla_runs[loss_type], record_run(trainer))


#: The other loss types, and sequence-level importance sampling (GSPO, LUSPO), over two passes per generation
#: batch so that the importance ratios differ from 1 (clipping, SAPO's gate and VESPO's weights act).
MOVING_RATIO_CASES = [(lt, "token") for lt in ALL_LOSS_TYPES if lt not in LOSS_TYPES] + [
    ("grpo", "sequence"),
    ("luspo", "sequence"),
    ("dapo", "sequence"),
]


@pytest.mark.parametrize(("loss_type", "level"), MOVING_RATIO_CASES)
def test_plugin_loss_path_with_neutral_plugin_is_identical_for_every_loss_type(loss_type, level, temporary_plugin):
    temporary_plugin(NeutralLossPlugin)
    run = dict(RUN, loss_type=loss_type, importance_sampling_level=level, num_iterations=2)
    vanilla = record_run(make_tiny_trainer(GRPOTrainer, **run))
    trainer = make_tiny_trainer(plugins=["neutral_loss"], **run)
    assert trainer._uses_plugin_loss
    ours = record_run(trainer)
    assert any(g.abs().sum() > 0 for grads in vanilla.grads for g in grads.values())
    assert_runs_equal(vanilla, ours)
    # TRL's logged metrics (clip ratios, cispo_clip_ratio, vespo/phi_seq_mean, entropy ...) are TRL's too
    assert len(ours.logs) == len(vanilla.logs)
    for theirs, mine in zip(vanilla.logs, ours.logs):
        timing_free = [k for k in theirs if not any(word in k for word in ("time", "runtime", "per_second"))]
        assert {k: mine.get(k) for k in timing_free} == {k: theirs[k] for k in timing_free}


@pytest.mark.parametrize("extra", [dict(beta=0.05), dict(entropy_coef=0.01), dict(top_entropy_quantile=0.5)])
def test_plugin_loss_path_matches_trl_options(extra, temporary_plugin, tmp_path):
    """KL to the reference, the entropy bonus and the entropy mask go through the plugin path unchanged."""
    temporary_plugin(NeutralLossPlugin)
    # with beta != 0 TRL loads the reference model by name/path: use a locally saved tiny model
    path = str(build_and_save(tmp_path / "tiny"))
    vanilla = record_run(make_tiny_trainer(GRPOTrainer, model=path, loss_type="dapo", **RUN, **extra))
    ours = record_run(make_tiny_trainer(model=path, loss_type="dapo", plugins=["neutral_loss"], **RUN, **extra))
    assert_runs_equal(vanilla, ours)


# ------------------------------------------------------------------------------------------ multi-turn tool rollouts
@pytest.mark.parametrize("agent", ["environment", pytest.param("tools", marks=pytest.mark.slow)])
def test_tool_run_without_plugins_is_identical_to_trl(agent):
    vanilla_trainer = make_tool_trainer(GRPOTrainer, agent=agent)
    vanilla = record_run(vanilla_trainer)
    ours = record_run(make_tool_trainer(agent=agent))
    # not vacuous: tool calls were made (TRL logs them) and the runs have signal
    assert all(log["tools/call_frequency"] > 0 for log in vanilla.logs if "tools/call_frequency" in log)
    assert any(adv.abs().sum() > 0 for adv in vanilla.advantages)
    assert_runs_equal(vanilla, ours)


@pytest.mark.slow
def test_tool_run_through_the_plugin_loss_path_is_identical(temporary_plugin):
    """A neutral plugin (every stage's data built: turn ids, plugin loss path) changes nothing with tools either."""
    temporary_plugin(NeutralLossPlugin)
    vanilla = record_run(make_tool_trainer(GRPOTrainer))
    trainer = make_tool_trainer(plugins=["neutral_loss"])
    assert trainer._uses_plugin_loss
    assert_runs_equal(vanilla, record_run(trainer))

"""Tool-episode replay (RolloutContext.store_tool_episodes / replay_tool_episodes, StoredEpisode): the stored episode
refused at construction on bad input and its checkpoint round trip, the behaviour log-probs that replace the old
log-probs in the loss (NaN elsewhere), the calls replayed on the fresh environment (only those TRL executed), and the
seam's refusals. The round trip on the tiny tool trainer and the exact ratio are in tests/plugins/test_replay.py
(tool episodes) and tests/plugins/test_adaptive_sampler.py (RAPO replay buffers)."""

import math
from types import SimpleNamespace

import pytest
import torch

from trl_plugins.api import PluginError, StoredEpisode
from trl_plugins.runtime.episode_replay import (
    behaviour_logps_tensor, executed_messages, replay_episodes, store_episodes,
)
from trl_plugins.runtime.loss_rules import with_behaviour_logps
from trl_plugins.testing import make_rollout_context

A1 = {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "search",
                                                                                       "arguments": {"query": "x"}}}]}
T1 = {"role": "tool", "name": "search", "content": "doc"}
A2 = {"role": "assistant", "content": "Answer: 3"}


def _episode(**changes):
    values = dict(prompt_ids=[9, 8], completion_ids=[1, 2, 7, 7, 4], tool_mask=[1, 1, 0, 0, 1],
                  messages=[A1, T1, A2], logprobs=[-0.5, -1.0, None, 0.3, -2.0], step=3, global_row=5)
    values.update(changes)
    return StoredEpisode(**values)


def test_a_stored_episode_forces_nan_on_tool_results_and_round_trips():
    e = _episode()
    assert e.logprobs[:2] == [-0.5, -1.0] and math.isnan(e.logprobs[2]) and math.isnan(e.logprobs[3])
    assert e.num_turns == 2
    back = StoredEpisode.from_state(e.state())
    assert back.completion_ids == e.completion_ids and back.messages == e.messages and back.step == 3
    assert back.state()["messages"] is not e.state()["messages"]  # a copy, never the buffer's own


@pytest.mark.parametrize("changes, match", [
    ({"prompt_ids": []}, "prompt_ids is empty"),
    ({"completion_ids": [], "tool_mask": [], "logprobs": []}, "completion_ids is empty"),
    ({"tool_mask": [1, 1, 0, 0]}, "4 tool-mask values and 5 log-probs for 5 completion tokens"),
    ({"tool_mask": [1, 2, 0, 0, 1]}, "tool_mask value 2; allowed: 0"),
    ({"tool_mask": [0, 0, 0, 0, 0]}, "with at least one model token"),
    ({"logprobs": [-0.5, float("nan"), 0.0, 0.0, -2.0]}, "behaviour log-prob nan at model token 1"),
    ({"logprobs": [-0.5, 0.25, 0.0, 0.0, -2.0]}, "behaviour log-prob 0.25 at model token 1; allowed: a finite"),
    ({"logprobs": [-0.5, -1.0, 0.0, 0.0, float("-inf")]}, "behaviour log-prob -inf at model token 4"),
    ({"messages": [T1]}, "no assistant message"),
])
def test_bad_stored_episodes_are_refused_at_construction(changes, match):
    with pytest.raises(PluginError, match=match):
        _episode(**changes)


def test_behaviour_logprobs_replace_the_old_logprobs_where_finite():
    old = torch.tensor([[-1.0, -2.0, -3.0], [-4.0, -5.0, -6.0]])
    behaviour = torch.tensor([[-0.5, float("nan"), -0.25], [float("nan")] * 3])
    out = with_behaviour_logps(old, behaviour)
    assert out.tolist() == [[-0.5, -2.0, -0.25], [-4.0, -5.0, -6.0]]
    assert with_behaviour_logps(old, None) is old


def test_the_behaviour_tensor_holds_the_replayed_rows_only():
    out = behaviour_logps_tensor({1: [-0.5, float("nan"), -1.0]}, 3, 4, "cpu")
    assert torch.isnan(out[[0, 2]]).all() and torch.isnan(out[1, 1]) and torch.isnan(out[1, 3])
    assert out[1, [0, 2]].tolist() == [-0.5, -1.0]


def test_only_the_calls_trl_executed_are_replayed():
    assert executed_messages([A1, T1, A2]) == [A1, T1]
    assert executed_messages([A1, T1, A1]) == [A1, T1]  # the last turn's call was left unanswered
    assert executed_messages([A2]) == []


def _fake_trainer():
    acc = SimpleNamespace(num_processes=1, gather=lambda t: t, device="cpu")
    return SimpleNamespace(accelerator=acc, batch_environment_names=None, max_completion_length=4,
                           environment_factories=None, tool_dicts_for=lambda env: ({}, {}),
                           raise_reset_errors_together=lambda envs: None)


def _tool_ctx():
    ctx = make_rollout_context(["a", "b"], num_generations=2)
    ctx.turns = [SimpleNamespace(tool_mask=[1]), SimpleNamespace(tool_mask=[1])]
    return ctx


def test_the_seam_refuses_runs_without_tools_and_bad_rows():
    ctx = make_rollout_context(["a", "b"], num_generations=2)
    with pytest.raises(PluginError, match="the run has no tools"):
        replay_episodes(_fake_trainer(), ctx, [0], [_episode()])
    with pytest.raises(PluginError, match="the run has no tools"):
        store_episodes(_fake_trainer(), ctx, [0])
    with pytest.raises(PluginError, match=r"row 7; allowed: a local row index in \[0, 2\)"):
        replay_episodes(_fake_trainer(), _tool_ctx(), [7], [_episode()])


@pytest.mark.parametrize("episodes, match", [
    ([], "0 episodes for 1 rows; allowed: one per row"),
    (["ids"], "got str for local row 0; allowed: a StoredEpisode"),
    ([_episode()], "prompt ids differ from local row 0's"),
])
def test_replay_refuses_a_bad_request_naming_it(episodes, match):
    with pytest.raises(PluginError, match=match):
        replay_episodes(_fake_trainer(), _tool_ctx(), [0], episodes)


def test_replay_refuses_an_episode_longer_than_the_completion_limit():
    ctx = _tool_ctx()
    with pytest.raises(PluginError, match="has 5 tokens; allowed: at most max_completion_length=4"):
        replay_episodes(_fake_trainer(), ctx, [0], [_episode(prompt_ids=ctx.prompt_ids[0])])

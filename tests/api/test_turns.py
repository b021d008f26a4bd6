"""Turn structure of multi-turn tool rollouts: the unit (trl_plugins.api.turns) and what the stage contexts carry."""

import math

import pytest
import torch

from trl_plugins import Plugin, hookimpl
from trl_plugins.api.errors import IncompatiblePluginsError
from trl_plugins.runtime.manager import available_plugins, build_plugins
from trl_plugins.api.turns import build_turn_structure, expand_turn_values, single_turn, turn_ids_tensor

MESSAGES = [
    {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "search",
                                                                                             "arguments": {"q": 1}}}]},
    {"role": "tool", "name": "search", "content": "doc"},
    {"role": "assistant", "content": "Answer: 3"},
]


def test_spans_follow_the_tool_mask_and_calls_their_turns():
    ids = list(range(10))
    mask = [1, 1, 1, 0, 0, 0, 1, 1, 1, 1]
    turns = build_turn_structure(ids, mask, MESSAGES, call_rewards=[0.5])
    assert turns.assistant_spans == [(0, 3), (6, 10)]
    assert turns.tool_result_spans == [(3, 6)]
    assert turns.tool_calls == [[{"name": "search", "arguments": {"q": 1}}], []]
    assert turns.tool_call_spans == [(0, 3)]
    assert turns.turn_rewards[0] == 0.5 and math.isnan(turns.turn_rewards[1])
    assert turns.turn_ids() == [0, 0, 0, -1, -1, -1, 1, 1, 1, 1]


def test_tool_call_span_starts_at_the_marker_token():
    text = "ok<tool_call>{}"
    ids = [ord(c) for c in text]
    turns = build_turn_structure(ids, [1] * len(ids) + [0], MESSAGES[:2], decode_one=chr)
    assert turns.tool_call_spans == [(2, len(ids))]


def test_call_rewards_are_summed_per_turn():
    two_calls = dict(MESSAGES[0], tool_calls=MESSAGES[0]["tool_calls"] * 2)
    turns = build_turn_structure([0] * 4, [1, 0, 1, 1], [two_calls, MESSAGES[1], MESSAGES[2]], call_rewards=[1.0, 2.0])
    assert turns.turn_rewards[0] == 3.0


def test_without_tools_one_turn():
    assert build_turn_structure([5, 6, 7], None).assistant_spans == [(0, 3)]
    assert single_turn(0).num_turns == 0


def test_turn_values_expand_to_tokens():
    turn_ids = turn_ids_tensor([build_turn_structure(list(range(6)), [1, 1, 0, 0, 1, 1], MESSAGES)], width=8)
    assert turn_ids.tolist() == [[0, 0, -1, -1, 1, 1, -1, -1]]
    tokens = expand_turn_values(torch.tensor([[2.0, -1.0]]), turn_ids, fill=0.0)
    assert tokens.tolist() == [[2.0, 2.0, 0.0, 0.0, -1.0, -1.0, 0.0, 0.0]]


def test_every_builtin_plugin_states_multi_turn_support():
    builtin = {n: c for n, c in available_plugins().items() if c.__module__.startswith("trl_plugins_builtin.")}
    assert builtin
    unstated = [n for n, c in builtin.items() if c.multi_turn is None]
    assert not unstated, f"built-in plugins without Plugin.multi_turn: {unstated}"
    assert all(c.multi_turn is True or (isinstance(c.multi_turn, str) and c.multi_turn.endswith(".")) for c in
               builtin.values())


def test_a_plugin_that_cannot_run_multi_turn_is_refused_with_its_reason():
    stack = build_plugins(["hint_scaffold"])
    with pytest.raises(IncompatiblePluginsError, match="hint_scaffold.*multi-turn.*edits completions"):
        stack.check_multi_turn()
    build_plugins(["lp_reg"]).check_multi_turn()  # states True: accepted


def test_empo_is_refused_only_with_extra_votes():
    build_plugins(["empo"]).check_multi_turn()
    with pytest.raises(IncompatiblePluginsError, match="vote_pool"):
        build_plugins(["empo"], {"empo": {"vote_pool": 8, "mode": "majority_vote"}}).check_multi_turn()


class RecordTurns(Plugin):
    """Records the turn fields of the advantage and loss contexts."""

    name = "record_turns"
    multi_turn = True
    seen: dict = {}

    @hookimpl
    def trl_plugins_transform_rewards(self, ctx):
        type(self).seen["reward_turns"] = list(ctx.local_turns)
        first = ctx.local_turns[0]
        first.turn_rewards = [5.0] * first.num_turns  # per-turn rewards set here reach the advantage stage

    @hookimpl
    def trl_plugins_transform_advantages(self, ctx):
        type(self).seen["advantage"] = (ctx.turn_ids.clone(), ctx.turn_rewards.clone(), list(ctx.local_turns))
        token_level = ctx.expand_turns(torch.ones(ctx.turn_ids.size(0), ctx.turn_rewards.size(1)))
        type(self).seen["expanded"] = token_level

    @hookimpl
    def trl_plugins_loss(self, ctx):
        type(self).seen.setdefault("loss", []).append((ctx.turn_ids.clone(), ctx.inputs["tool_mask"].clone(),
                                                       ctx.mask.clone()))


@pytest.mark.slow
def test_contexts_carry_the_turns_of_real_tool_rollouts(temporary_plugin):
    from trl_plugins.testing import make_tool_trainer

    temporary_plugin(RecordTurns)
    RecordTurns.seen = {}
    trainer = make_tool_trainer(plugins=["record_turns"], max_steps=1)
    trainer.train()
    seen = RecordTurns.seen
    turn_ids, turn_rewards, turns = seen["advantage"]
    assert any(t.num_tool_calls > 0 for t in turns) and seen["reward_turns"] == turns
    # the environment's per-call reward (a search hit on the question's place) lands on the calling turn
    assert (turn_rewards[0, : turns[0].num_turns] == 5.0).all()
    for row, turn in enumerate(turns):
        for u, calls in enumerate(turn.tool_calls):
            if row > 0:
                assert (turn_rewards[row, u] == 1.0) if calls else math.isnan(turn_rewards[row, u])
        # turn ids are -1 exactly on tool-result tokens (and padding)
        ids = turn_ids[row, : len(turn.tool_mask)]
        assert ((ids == -1) == (torch.tensor(turn.tool_mask) == 0)).all()
    assert (seen["expanded"] == (turn_ids >= 0).float()).all()
    for loss_turn_ids, tool_mask, mask in seen["loss"]:
        valid = mask.bool()
        assert (loss_turn_ids[valid] >= 0).all()  # every trained token belongs to an assistant turn
        assert ((loss_turn_ids == -1) | (tool_mask == 1)).all()


@pytest.mark.parametrize("reward, expected", [
    (float("nan"), "turn_rewards[0] of row 0 is nan; allowed: a finite number (one per tool call)"),
    (float("-inf"), "turn_rewards[0] of row 0 is -inf"),
    ("0.5", "turn_rewards[0] of row 0 is '0.5'"),
    (True, "turn_rewards[0] of row 0 is True"),
])
def test_an_environment_turn_reward_that_cannot_enter_the_loss_is_refused_naming_it_and_the_row(
        reward, expected, monkeypatch):
    from trl_plugins import PluginError
    from trl_plugins.tasks.tools import ToolEnvironment
    from trl_plugins.testing import make_tool_trainer

    original = ToolEnvironment._record
    monkeypatch.setattr(ToolEnvironment, "_record",
                        lambda self, name, arguments, result, value: original(self, name, arguments, result, reward))
    trainer = make_tool_trainer(plugins=["lp_reg"], max_steps=1)  # any plugin: the turns reach the plugin stages
    with pytest.raises(PluginError) as err:
        trainer.train()
    assert "environment ToolEnvironment: " + expected in str(err.value)
    assert trainer.state.global_step == 0


def test_environment_call_rewards_refuses_what_is_not_a_list_of_finite_numbers():
    from trl_plugins.api.turns import environment_call_rewards

    class Env:
        turn_rewards = 1.0

    assert environment_call_rewards(object(), 3) == (None, None)
    rewards, problem = environment_call_rewards(Env(), 3)
    assert rewards is None and "turn_rewards of row 3 is float 1.0; allowed: a list" in str(problem)
    Env.turn_rewards = [1, 0.5]
    assert environment_call_rewards(Env(), 3) == ([1.0, 0.5], None)

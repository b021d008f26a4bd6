"""SALT: steps the trajectories of a prompt share merge into one graph node; each step gets its node's mean advantage."""

import pytest
import torch

from trl_plugins import PluginConfigError, build_plugins
from trl_plugins.testing import make_advantage_context, run_hook, run_on_processes
from trl_plugins.api.turns import build_turn_structure
from trl_plugins_builtin.salt import graph_advantages, step_keys, step_values

PATTERN = [1, 1, 0, 0, 1, 1]  # turn 0 (tokens 0-1), tool result (2-3), turn 1 (4-5)
TOOL = {"role": "tool", "name": "search", "content": "doc"}


def call(name, **arguments):
    return {"role": "assistant", "content": "",
            "tool_calls": [{"function": {"name": name, "arguments": arguments}}]}


def trajectory(first_call, answer_tokens, call_tokens=(10, 11)):
    """(TurnStructure, completion ids) of: a tool call, its result, an answer turn."""
    messages = [first_call, TOOL, {"role": "assistant", "content": "answer"}]
    ids = [*call_tokens, 90, 91, *answer_tokens]
    return build_turn_structure(ids, PATTERN, messages), ids


def context(trajectories, rewards, G, **kw):
    turns = [t for t, _ in trajectories]
    ctx = make_advantage_context(rewards, num_generations=G, turns=turns, scale_rewards=False, **kw)
    ctx.local_completion_ids = torch.tensor([ids for _, ids in trajectories])
    return ctx


def run(ctx, **options):
    return run_hook("salt", "transform_advantages", ctx, options=options)


SEARCH_X, CALC_Y = call("search", query="x"), call("calculator", expression="y")


def three_trajectories():
    # A and B make the same first call, then answer differently; C calls another tool, then answers like A.
    return [trajectory(SEARCH_X, (7, 7)), trajectory(SEARCH_X, (8, 8)), trajectory(CALC_Y, (7, 7), (12, 13))]


def test_shared_step_gets_the_mean_advantage_of_its_trajectories():
    # rewards 1, 0, 0 -> GRPO advantages (unscaled) 2/3, -1/3, -1/3
    ctx = run(context(three_trajectories(), [1.0, 0.0, 0.0], G=3))
    adv = ctx.advantages
    assert adv.shape == (3, 6)
    shared = (2 / 3 - 1 / 3) / 2  # A's and B's first step are one node
    assert adv[0, 0] == pytest.approx(shared) and adv[1, 1] == pytest.approx(shared)
    assert adv[2, 0] == pytest.approx(-1 / 3)  # C's first step is its own
    # second steps: distinct histories, so each keeps its trajectory's advantage
    assert adv[0, 4] == pytest.approx(2 / 3) and adv[1, 4] == pytest.approx(-1 / 3) and adv[2, 5] == pytest.approx(-1 / 3)
    assert torch.all(adv[:, 2:4] == 0)  # tool-result tokens carry no advantage
    assert ctx.metrics["plugins/salt/shared_step_fraction"] == [pytest.approx(2 / 6)]


def test_a_step_every_trajectory_shares_is_neutral_under_grpo():
    trajectories = [trajectory(SEARCH_X, (7, 7)), trajectory(SEARCH_X, (8, 8))]
    ctx = run(context(trajectories, [1.0, 0.0], G=2))
    assert torch.all(ctx.advantages[:, :2] == 0)  # the shared first call is neither rewarded nor penalised
    assert ctx.advantages[0, 4] == pytest.approx(0.5) and ctx.advantages[1, 4] == pytest.approx(-0.5)


def test_step_identity_turn_action_merges_same_action_at_same_turn_whatever_the_history():
    ctx = run(context(three_trajectories(), [1.0, 0.0, 0.0], G=3), step_identity="turn_action")
    # A's and C's answers (tokens 7 7 at turn 1) merge although their first calls differ
    assert ctx.advantages[0, 4] == pytest.approx((2 / 3 - 1 / 3) / 2)
    assert ctx.advantages[2, 4] == pytest.approx((2 / 3 - 1 / 3) / 2)
    assert ctx.advantages[1, 4] == pytest.approx(-1 / 3)


def test_action_tokens_tells_calls_apart_by_their_text():
    # same parsed call, different tokens: one node under 'tool_calls', two under 'tokens'
    trajectories = [trajectory(SEARCH_X, (7, 7), (10, 11)), trajectory(SEARCH_X, (8, 8), (10, 12))]
    by_calls = run(context(trajectories, [1.0, 0.0], G=2))
    by_tokens = run(context(trajectories, [1.0, 0.0], G=2), action="tokens")
    assert by_calls.advantages[0, 0] == pytest.approx(0.0)
    assert by_tokens.advantages[0, 0] == pytest.approx(0.5) and by_tokens.advantages[1, 0] == pytest.approx(-0.5)


def test_steps_of_different_prompts_never_merge():
    # two groups of 2, every trajectory makes the same first call: nodes are per prompt
    trajectories = [trajectory(SEARCH_X, (7, 7)), trajectory(SEARCH_X, (8, 8))] * 2
    ctx = run(context(trajectories, [1.0, 0.0, 1.0, 1.0], G=2))
    assert torch.all(ctx.advantages[:, :2] == 0)  # group 0: +-0.5 averaged; group 1: both 0
    assert ctx.advantages[0, 4] == pytest.approx(0.5) and ctx.advantages[2, 4] == pytest.approx(0.0)


def test_token_level_incoming_advantages_use_each_steps_token_mean():
    trajectories = [trajectory(SEARCH_X, (7, 7)), trajectory(SEARCH_X, (8, 8))]
    incoming = torch.tensor([[1.0, 3.0, 0.0, 0.0, 5.0, 5.0], [-2.0, -2.0, 0.0, 0.0, -1.0, -1.0]])
    ctx = run(context(trajectories, [1.0, 0.0], G=2, advantages=incoming))
    assert ctx.advantages[0, 0] == pytest.approx((2.0 + -2.0) / 2)  # step means 2 and -2, merged
    assert ctx.advantages[0, 4] == pytest.approx(5.0) and ctx.advantages[1, 5] == pytest.approx(-1.0)


def test_strength_mixes_and_zero_is_neutral():
    ctx = context(three_trajectories(), [1.0, 0.0, 0.0], G=3)
    before = ctx.advantages.clone()
    run(ctx, strength=0.0)
    assert torch.equal(ctx.advantages, before)
    half = run(context(three_trajectories(), [1.0, 0.0, 0.0], G=3), strength=0.5)
    assert half.advantages[0, 0] == pytest.approx(0.5 * 2 / 3 + 0.5 * (2 / 3 - 1 / 3) / 2)


def test_single_turn_rollouts_are_left_alone():
    ctx = make_advantage_context([1.0, 0.0, 0.0, 1.0], num_generations=2)
    before = ctx.advantages.clone()
    run(ctx)
    assert torch.equal(ctx.advantages, before)


def test_graph_helpers_on_hand_values():
    assert step_keys([5, 6], "action") == [5, 6]
    history = step_keys([5, 6], "history")
    assert history[0] != history[1] and step_keys([5, 7], "history")[0] == history[0]
    values = step_values(torch.tensor([1.0, -1.0]), torch.tensor([[0, 0, -1, 1], [0, -1, 1, 1]]), 2)
    assert torch.equal(values, torch.tensor([[1.0, 1.0], [-1.0, -1.0]]))
    keys = torch.tensor([[1, 2], [1, 3]])
    merged, shared = graph_advantages(values, keys, torch.tensor([2, 1]), torch.tensor([0, 0]))
    assert merged[0, 0] == 0.0 and merged[1, 0] == 0.0 and merged[0, 1] == 1.0 and torch.isnan(merged[1, 1])
    assert shared.tolist() == [[True, False], [True, False]]


def test_two_processes_build_the_same_graph_as_one():
    trajectories = three_trajectories() + [trajectory(CALC_Y, (8, 8), (12, 13))]
    rewards = [1.0, 0.0, 0.0, 1.0]
    single = run(context(trajectories, rewards, G=4)).advantages

    def work(rank, gather):
        # every process holds the gathered (global) fields; the turn structures and token ids are its own rows
        ctx = context(trajectories, rewards, G=4, gather=gather)
        local = slice(2 * rank, 2 * rank + 2)
        ctx.local_turns = ctx.local_turns[local]
        ctx.local_completion_ids = ctx.local_completion_ids[local]
        ctx.process_slice = local
        return run(ctx).advantages

    first, second = run_on_processes(2, work)
    assert torch.equal(first, single) and torch.equal(second, single)


@pytest.mark.parametrize("options, match", [
    ({"step_identity": "prefix"}, "step_identity"), ({"action": "text"}, "action"), ({"strength": 1.5}, "strength"),
])
def test_bad_options_are_refused_at_construction(options, match):
    with pytest.raises(PluginConfigError, match=match):
        build_plugins(["salt"], {"salt": options})


def shared_call_then_split(dataset):
    """A scripted policy: every rollout makes the question's gold call (one shared step), then even rows answer right
    and odd rows wrong (distinct final steps)."""
    import json

    traces = {row["prompt"][-1]["content"]: (json.loads(row["gold_calls"]), row["answer"]) for row in dataset}

    def script(prompt_text, row):
        calls, answer = next(v for q, v in traces.items() if q in prompt_text)
        if "<tool_response>" not in prompt_text:
            return f"<tool_call>{json.dumps(calls[0])}</tool_call>"
        return f"Answer: {answer if row % 2 == 0 else int(answer) + 1}"

    return script


def test_salt_trains_on_real_tool_rollouts():
    from trl_plugins.tasks.tools import make_tool_dataset
    from trl_plugins.testing import make_tool_trainer, record_run

    script = shared_call_then_split(make_tool_dataset(8, kinds=("lookup",)))
    kw = dict(kinds=("lookup",), script=script, max_steps=1)
    vanilla = record_run(make_tool_trainer(**kw))
    ours = record_run(make_tool_trainer(plugins=["salt"], **kw))
    adv, before = ours.advantages[0], vanilla.advantages[0]
    assert adv.dim() == 2 and before.dim() == 1 and torch.all(before != 0)  # right and wrong answers in each group
    # token 0 belongs to the shared tool call: neutral under SALT (GRPO gave it +-A); the answer turn keeps its
    # trajectory's advantage (the rows answering alike merge, with equal advantages)
    assert torch.all(adv[:, 0] == 0)
    for row in range(adv.size(0)):
        acted = adv[row][adv[row] != 0]
        assert acted.numel() > 0 and torch.allclose(acted, before[row].expand_as(acted))
    logs = {k: v for log in ours.logs for k, v in log.items()}
    assert 0 < logs["plugins/salt/shared_step_fraction"] <= 1 and logs["plugins/salt/steps_mean"] == 2


def test_salt_with_strength_zero_reduces_to_vanilla_on_tool_rollouts():
    from trl import GRPOTrainer

    from trl_plugins.testing import assert_runs_equal, make_tool_trainer, record_run

    vanilla = record_run(make_tool_trainer(GRPOTrainer, max_steps=1))
    ours = record_run(make_tool_trainer(plugins=["salt"], plugin_config={"salt": {"strength": 0.0}}, max_steps=1))
    assert_runs_equal(vanilla, ours)

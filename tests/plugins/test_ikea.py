"""IKEA: correct answers earn more the fewer searches they needed; failed answers earn a little for having searched."""

import pytest
import torch

from trl_plugins import PluginConfigError
from trl_plugins.testing import build_stack, make_reward_context, run_hook
from trl_plugins.api.turns import build_turn_structure
from trl_plugins_builtin.ikea import knowledge_boundary_reward, retrieval_count

TOOL = {"role": "tool", "name": "search", "content": "doc"}
ANSWER = {"role": "assistant", "content": "Answer: 1"}


def _call(name):
    return {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": name, "arguments": {}}}]}


def _turns(*names):
    """A completion calling the tools ``names`` (one per turn) before answering."""
    mask, messages = [], []
    for name in names:
        mask += [1, 1, 0]
        messages += [_call(name), TOOL]
    return build_turn_structure(list(range(len(mask) + 2)), mask + [1, 1], messages + [ANSWER])


def _reward(verifier, turns, **options):
    """Run the transform on (N, 2) [verifier, ikea placeholder] rewards; return the ikea column."""
    matrix = torch.tensor([[v, 0.0] for v in verifier])
    ctx = make_reward_context(matrix, num_generations=len(verifier), reward_func_names=["accuracy", "ikea"],
                              turns=turns)
    run_hook("ikea", "trl_plugins_transform_rewards", ctx, {"ikea": options})
    assert torch.equal(ctx.rewards_per_func[:, 0], matrix[:, 0])  # the verifier column is never touched
    return ctx


def test_knowledge_boundary_reward_uses_the_papers_constants():
    correct = torch.tensor([True, True, True, True, True, False, False])
    searches = torch.tensor([0, 1, 2, 3, 5, 0, 2])
    values = knowledge_boundary_reward(correct, searches, r_kb_plus=0.6, r_kb_minus=0.05, rt_max=3)
    assert values.tolist() == pytest.approx([0.6, 0.4, 0.2, 0.0, 0.0, 0.0, 0.05])


def test_fewer_searches_score_higher_among_correct_answers():
    turns = [_turns(), _turns("search"), _turns("search", "search", "search"), _turns("search"), _turns()]
    ctx = _reward([1.0, 1.0, 1.0, 0.0, 0.0], turns)
    assert ctx.rewards_per_func[:, 1].tolist() == pytest.approx([0.6, 0.4, 0.0, 0.05, 0.0])
    total = ctx.rewards_per_func.sum(dim=1)  # TRL's sum r_ans + r_kb
    assert total[0] > total[1] > total[2] > total[3] > total[4]
    assert ctx.metrics["plugins/ikea/retrievals_mean"] == [pytest.approx(5 / 5)]


def test_only_search_tools_count_as_retrievals():
    assert retrieval_count(_turns("search", "calculator", "search").tool_calls, ["search"]) == 2
    assert retrieval_count(_turns("search", "calculator").tool_calls, []) == 2  # empty: every tool counts
    ctx = _reward([1.0], [_turns("calculator")])
    assert ctx.rewards_per_func[0, 1] == pytest.approx(0.6)  # a calculator call is not a retrieval


def test_success_follows_the_configured_rule():
    turns = [_turns("search"), _turns("search")]
    ctx = _reward([0.4, 0.9], turns, success_threshold=0.5)
    assert ctx.rewards_per_func[:, 1].tolist() == pytest.approx([0.05, 0.4])


def test_neutral_setting_leaves_trls_sum():
    stack = build_stack(["ikea"], {"ikea": {"reward_weight": 0.0}})
    (func,) = [f for _, funcs in stack.call("trl_plugins_reward_functions", args=None) for f in funcs]
    assert func.reward_weight == 0.0  # the column adds nothing to TRL's weighted sum
    # and with both constants at 0 the column itself is 0
    ctx = _reward([1.0, 0.0], [_turns(), _turns("search")], r_kb_plus=0.0, r_kb_minus=0.0)
    assert ctx.rewards_per_func[:, 1].tolist() == [0.0, 0.0]


def test_bad_options_are_refused_at_construction():
    with pytest.raises(PluginConfigError, match="rt_max"):
        build_stack(["ikea"], {"ikea": {"rt_max": 0}})
    with pytest.raises(PluginConfigError, match="r_kb_minus"):
        build_stack(["ikea"], {"ikea": {"r_kb_minus": -0.1}})
    with pytest.raises(PluginConfigError, match="search_tools"):
        build_stack(["ikea"], {"ikea": {"search_tools": "search"}})


@pytest.mark.slow
def test_ikea_column_on_real_tool_rollouts():
    from trl_plugins.testing import make_tool_trainer, record_run

    run = record_run(make_tool_trainer(plugins=["ikea"], max_steps=1))
    rewards = run.rewards[0]
    assert rewards.shape[1] == 2
    correct = rewards[:, 0] > 0
    # lookup questions need one search (0.4 when correct); the scripted shortcuts answer wrong without searching (0)
    # and scaled questions search once and use the calculator (0.4 when correct)
    assert correct.any() and (~correct).any()
    assert torch.allclose(rewards[correct, 1], torch.full_like(rewards[correct, 1], 0.4))
    assert torch.equal(rewards[~correct, 1], torch.zeros_like(rewards[~correct, 1]))
    assert any("plugins/ikea/retrievals_mean" in log for log in run.logs)


def test_two_processes_agree_with_one():
    from trl_plugins.testing import run_on_processes

    turns = [_turns(), _turns("search"), _turns("search", "search"), _turns("search")]
    matrix = torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 0.0], [0.0, 0.0]])

    def work(rank, gather):
        ctx = make_reward_context(matrix, num_generations=2, reward_func_names=["accuracy", "ikea"], turns=turns,
                                  num_processes=2, process_index=rank, gather=gather)
        run_hook("ikea", "trl_plugins_transform_rewards", ctx)
        return ctx.rewards_per_func[:, 1].tolist()

    first, second = run_on_processes(2, work, timeout=10)
    assert first == second == pytest.approx([0.6, 0.4, 0.05, 0.05])


def test_search_tools_naming_no_tool_of_the_run_is_refused_when_the_trainer_is_built():
    from trl_plugins.testing import make_tool_trainer

    with pytest.raises(PluginConfigError) as err:
        make_tool_trainer(plugins=["ikea"], plugin_config={"ikea": {"search_tools": ["serach"]}}, max_steps=1)
    message = str(err.value)
    assert "Option 'search_tools' of plugin 'ikea' got ['serach']; 'serach' is not a tool of this run" in message
    assert "(tools: calculator, search). Did you mean 'search'?" in message
    make_tool_trainer(plugins=["ikea"], plugin_config={"ikea": {"search_tools": []}}, max_steps=1)  # every call counts

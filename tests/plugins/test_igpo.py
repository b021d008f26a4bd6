"""IGPO / A2TGPO: turn rewards are the rise of the policy's probability of the answer; advantages per turn."""

import math

import pytest
import torch

from trl_plugins import IncompatiblePluginsError
from trl_plugins.testing import (
    build_stack,
    group_normalized_advantages,
    make_advantage_context,
    make_loss_context,
    run_hook,
)
from trl_plugins.api.turns import build_turn_structure, turn_ids_tensor
from trl_plugins_builtin.igpo import CLIP_FACTORS_EXTRA, accumulate, clip_factors, normalise, turn_reward_matrix

CALL = {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "search", "arguments": {}}}]}
ANSWER = {"role": "assistant", "content": "Answer: 7"}
TOOL = {"role": "tool", "name": "search", "content": "doc"}


def _turns(pattern):
    """TurnStructure of a completion given by its tool mask pattern, e.g. [1, 1, 0, 0, 1]."""
    runs = sum(1 for t, m in enumerate(pattern) if m == 1 and (t == 0 or pattern[t - 1] == 0))
    messages = []
    for u in range(runs):
        messages += [CALL, TOOL] if u < runs - 1 else [ANSWER]
    return build_turn_structure(list(range(len(pattern))), pattern, messages)


class Beliefs:
    """policy_logprobs stub: the answer's per-token log-prob depends on how much of the completion was seen."""

    def __init__(self, by_prefix):
        self.by_prefix = by_prefix  # prefix length (prompt + completion part) -> probability
        self.calls = []

    def __call__(self, prompt_ids, completion_ids):
        self.calls.append(len(prompt_ids))
        return [torch.full((len(c),), math.log(self.by_prefix[len(p)])) for p, c in zip(prompt_ids, completion_ids)]


def _ctx(patterns, rewards, beliefs, G=2, **kw):
    turns = [_turns(p) for p in patterns]
    width = max(len(p) for p in patterns)
    ids = torch.zeros(len(patterns), width, dtype=torch.long)
    ctx = make_advantage_context(
        rewards, num_generations=G, turns=turns, rows=[{"answer": "7"}] * len(patterns),
        prompt_ids=[[1, 2]] * len(patterns), policy_logprobs=beliefs, **kw,
    )
    ctx.local_completion_ids = ids
    return ctx


def _run(ctx, **options):
    return run_hook("igpo", "trl_plugins_transform_advantages", ctx, {"igpo": options})


def test_information_gain_is_the_rise_of_the_answer_probability():
    # row 0: call, tool result, answer (2 turns); row 1: answers at once (1 turn)
    beliefs = Beliefs({2: 0.1, 2 + 4: 0.6})  # before turn 0 (prompt only): 0.1; before turn 1: 0.6
    ctx = _run(_ctx([[1, 1, 0, 0, 1, 1], [1, 1]], [1.0, 0.0], beliefs), scale=False)
    assert ctx.turn_rewards[0, 0] == pytest.approx(0.5)  # P_1 - P_0
    assert ctx.turn_rewards[0, 1] == 1.0 and ctx.turn_rewards[1, 0] == 0.0  # outcome on the last turn
    assert beliefs.calls == [2]  # one batched call: two probes of row 0, none for the single-turn row
    # IGPO: all turn rewards of the group centred together (mean of 0.5, 1.0, 0.0 = 0.5), then summed to the end
    adv = ctx.advantages
    assert adv[0, 0] == pytest.approx((0.5 - 0.5) + (1.0 - 0.5))  # turn 0: its reward plus the answer turn's
    assert adv[0, 4] == pytest.approx(1.0 - 0.5)
    assert adv[0, 2] == 0.0  # tool-result tokens carry no advantage
    assert adv[1, 0] == pytest.approx(0.0 - 0.5)


def test_without_tool_calls_igpo_is_grpo():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.5])
    ctx = _run(_ctx([[1, 1, 1]] * 4, rewards, Beliefs({})))
    expected = group_normalized_advantages(rewards, 2)
    assert torch.allclose(ctx.advantages[:, 0], expected) and torch.allclose(ctx.advantages[:, 2], expected)


def test_neutral_setting_leaves_trls_advantages():
    ctx = _ctx([[1, 0, 1], [1, 1, 1]], [1.0, 0.0], Beliefs({2: 0.5, 3: 0.9}))
    before = ctx.advantages.clone()
    _run(ctx, ig_weight=0.0)
    assert torch.equal(ctx.advantages, before)


def test_a2tgpo_normalises_per_turn_index_and_divides_by_sqrt_terms():
    gains = torch.tensor([[0.2, 0.0, 0.0], [0.6, 0.0, 0.0]])
    rewards = turn_reward_matrix(gains, torch.tensor([1.0, 0.0]), torch.tensor([2, 2]))
    assert torch.equal(rewards[:, :2], torch.tensor([[0.2, 1.0], [0.6, 0.0]])) and rewards[:, 2].isnan().all()
    adv = accumulate(rewards, gamma=1.0, sqrt_terms=True)
    assert adv[0, 0] == pytest.approx((0.2 + 1.0) / math.sqrt(2)) and adv[0, 1] == pytest.approx(1.0)
    beliefs = Beliefs({2: 0.1, 4: 0.3})
    ctx = _run(_ctx([[1, 0, 1], [1, 0, 1]], [1.0, 0.0], beliefs), mode="a2tgpo", scale=False)
    # both rows gain 0.2 on turn 0: centred within (prompt, turn 0) -> 0; outcomes centred per prompt -> +-0.5
    assert ctx.advantages[0, 0] == pytest.approx((0.0 + 0.5) / math.sqrt(2))
    assert ctx.advantages[1, 2] == pytest.approx(-0.5)


def test_a2tgpo_clip_factor_formula():
    g = torch.tensor([[-1.0, 0.0, 2.0, math.nan]])
    out = clip_factors(g, beta=0.3)
    sigmoid = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    expected = [1 + 0.3 * (2 * sigmoid(-1.0) - 1), 1.0, 1 + 0.3 * (2 * sigmoid(2.0) - 1), 1.0]
    torch.testing.assert_close(out[0], torch.tensor(expected))
    assert out[0, 0] < 1 < out[0, 2]  # an uninformative turn is narrowed, an informative one widened


# rows of one group: call (tokens 0-1), tool result (2), answer (3-4); row 1's call gains more than row 0's
PATTERN = [1, 1, 0, 1, 1]


def _a2tgpo_advantage_stage(**options):
    def per_row(prompt_ids, completion_ids):  # probes: (row 0 turn 0, row 0 turn 1, row 1 turn 0, row 1 turn 1)
        probabilities = [0.1, 0.3, 0.1, 0.7]
        return [torch.full((len(c),), math.log(q)) for q, c in zip(probabilities, completion_ids)]

    return _run(_ctx([PATTERN, PATTERN], [1.0, 0.0], per_row), mode="a2tgpo", scale=False, **options)


def test_a2tgpo_sends_each_turns_clip_factor_from_its_normalised_gain():
    ctx = _a2tgpo_advantage_stage()
    factors = ctx.extras[CLIP_FACTORS_EXTRA]
    # gains 0.2 and 0.6 on turn 0, centred within (prompt, turn 0): -0.2 and +0.2; the answer turn keeps 1
    expected_turn0 = 1 + 0.3 * (2 * torch.sigmoid(torch.tensor([-0.2, 0.2])) - 1)
    torch.testing.assert_close(factors[:, 0], expected_turn0)
    assert torch.equal(factors[:, 1], torch.ones(2))
    assert ctx.metrics["plugins/igpo/clip_factor_mean"] == [pytest.approx(float(expected_turn0.mean()))]


def _loss_ctx(extras, **kw):
    turn_ids = turn_ids_tensor([_turns(PATTERN)] * 2, len(PATTERN))
    logps = torch.log(torch.full((2, 5), 0.5)).requires_grad_(True)
    old = torch.log(torch.tensor([[0.5 / 1.25] * 5, [0.5 / 0.75] * 5]))  # ratios 1.25 (row 0) and 0.75 (row 1)
    return make_loss_context(logps, old_per_token_logps=old, advantages=[1.0, -1.0], turn_ids=turn_ids,
                             extras=extras, loss_type="grpo", epsilon_low=0.2, epsilon_high=0.2, **kw)


def test_a2tgpo_clips_each_token_with_its_turns_range():
    factors = torch.tensor([[1.3, 1.0], [0.7, 1.0]])  # row 0 turn 0 widened, row 1 turn 0 narrowed
    ctx = run_hook("igpo", "trl_plugins_loss_advantages", _loss_ctx({CLIP_FACTORS_EXTRA: factors}),
                   options={"mode": "a2tgpo"})
    expected_scale = torch.tensor([[1.3, 1.3, 1.0, 1.0, 1.0], [0.7, 0.7, 1.0, 1.0, 1.0]])
    torch.testing.assert_close(ctx.clip_scale, expected_scale)  # tool-result token 2: TRL's range (1)
    clipped = _loss_ctx({}, clip_scale=ctx.clip_scale)
    # -min(r A, clip(r, 1 - c eps, 1 + c eps) A): row 0 (r=1.25, A=1) is clipped at 1.2 by TRL, at 1.26 on turn 0;
    # row 1 (r=0.75, A=-1): loss max(0.75, clip) -> TRL's 0.8, turn 0's narrowed range gives 1 - 0.14 = 0.86
    expected = torch.tensor([[-1.25, -1.25, -1.2, -1.2, -1.2], [0.86, 0.86, 0.8, 0.8, 0.8]])
    torch.testing.assert_close(clipped.per_token_loss.detach(), expected)
    vanilla = _loss_ctx({})
    assert not torch.allclose(vanilla.per_token_loss, clipped.per_token_loss)


def test_a2tgpo_neutral_clip_is_trls_range():
    ctx = _a2tgpo_advantage_stage(clip_beta=0.0)
    assert CLIP_FACTORS_EXTRA not in ctx.extras  # nothing reaches the loss stage
    loss_ctx = run_hook("igpo", "trl_plugins_loss_advantages", _loss_ctx({}), options={"mode": "a2tgpo"})
    assert loss_ctx.clip_scale is None
    # igpo mode never clips per turn
    assert CLIP_FACTORS_EXTRA not in _run(_ctx([PATTERN, PATTERN], [1.0, 0.0], Beliefs({2: 0.1, 5: 0.3}))).extras


def test_a2tgpo_clipping_refuses_loss_types_without_a_clip_range():
    with pytest.raises(IncompatiblePluginsError, match="loss_type='cispo' has no clip range"):
        build_stack(["igpo"], {"igpo": {"mode": "a2tgpo"}}, loss_type="cispo")
    build_stack(["igpo"], {"igpo": {"mode": "a2tgpo", "clip_beta": 0.0}}, loss_type="cispo")


def test_normalise_keeps_nan_and_groups_apart():
    values = torch.tensor([[1.0, math.nan], [3.0, 5.0]])
    keys = torch.tensor([[0, 0], [0, 1]])
    out = normalise(values, keys, scale=False)
    assert out[0, 0] == -1.0 and out[1, 0] == 1.0 and out[1, 1] == 0.0 and math.isnan(out[0, 1])


def test_igpo_needs_the_answer_column():
    assert build_stack(["igpo"], {"igpo": {"answer_column": "gold"}}).plugins[0].required_columns() == ["gold"]


@pytest.mark.slow
def test_igpo_trains_on_real_tool_rollouts():
    from trl_plugins.testing import make_tool_trainer, record_run

    trainer = make_tool_trainer(plugins=["igpo"], max_steps=1)
    run = record_run(trainer)
    adv = run.advantages[0]
    assert adv.dim() == 2 and adv.abs().sum() > 0  # token-level advantages reached the loss
    assert any("plugins/igpo/info_gain_mean" in log for log in run.logs)


def _detour_script():
    """Every row follows its question's gold trace; odd rows first make a detour call, so both rows of a group have a
    first turn and their information gains differ (a turn-group of one row normalises to 0: clip factor 1)."""
    import re

    from trl_plugins.tasks.tools import gold_trace_script, make_tool_dataset

    gold = gold_trace_script(make_tool_dataset(8, kinds=("lookup", "scaled")), shortcut_every=0)
    detour = '<tool_call>{"name": "calculator", "arguments": {"expression": "1+1"}}</tool_call>'

    def script(prompt_text, row):
        if row % 2 == 0:
            return gold(prompt_text, row)
        if "<tool_response>" not in prompt_text:
            return detour
        return gold(re.sub(r"<tool_response>.*?</tool_response>", "", prompt_text, count=1, flags=re.S), row)

    return script


@pytest.mark.slow
def test_a2tgpo_clips_turns_on_real_tool_rollouts(monkeypatch):
    from trl_plugins import LossContext
    from trl_plugins.testing import make_tool_trainer, record_run

    scales = []
    original = LossContext.scale_clip_range

    def recording(self, scale):
        scales.append((scale.detach().clone(), self.turn_ids.clone()))
        return original(self, scale)

    monkeypatch.setattr(LossContext, "scale_clip_range", recording)
    trainer = make_tool_trainer(plugins=["igpo"], plugin_config={"igpo": {"mode": "a2tgpo"}}, max_steps=1,
                                loss_type="grpo", script=_detour_script())
    run = record_run(trainer)
    assert any("plugins/igpo/clip_factor_mean" in log for log in run.logs)
    assert scales, "the loss stage never received A2TGPO's clip factors"
    for scale, turn_ids in scales:
        assert torch.equal(scale[turn_ids < 0], torch.ones_like(scale[turn_ids < 0]))  # tool results, padding: 1
        assert ((scale > 1 - 0.3) & (scale < 1 + 0.3)).all()
    assert any((scale != 1).any() for scale, _ in scales)  # some turn's range really moved

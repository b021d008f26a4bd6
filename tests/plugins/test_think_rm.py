"""think_rm: pairwise generative-RM verdicts within each group -> Think-RM's group rewards and pairwise advantages.
Formula tests on small tensors against the official expression, transform tests with scripted judges, refusals,
the neutral setting and a trainer run."""

import math
from types import SimpleNamespace

import pytest
import torch
import trl

from trl_plugins import PluginConfigError, build_plugins
from trl_plugins.api.services import RunInfo
from trl_plugins.components.genrm import GenerativeRewardModel, GenRMParseError, ScriptedGenRMBackend, \
    clear_shared_genrm_backends
from trl_plugins.tasks.arithmetic import Problem, accuracy_reward, row_from_question
from trl_plugins.testing import (
    digit_fraction_reward,
    make_advantage_context,
    make_reward_context,
    make_tiny_trainer,
    record_run,
    script_generation,
)
from trl_plugins_builtin.think_rm import (
    BINARY_TEMPLATE,
    COLUMN,
    MULTICLASS_TEMPLATE,
    pair_matrix,
    pairwise_rewards,
)

PROBLEM = Problem.from_expression([3, 4, 2], ["+", "*"])
RIGHT, WRONG, WORSE = PROBLEM.solution, "3+4=7\n7*2=15\nAnswer: 15", "3+4=8\n8*2=16\nAnswer: 16"


def official_advantage(d, G, eps=1e-6):
    """The official compute_grpo_difference_advantage on a full (N, N) matrix (NaN outside groups, 0 diagonal)."""
    numer = torch.nansum(d, dim=1) / G
    out = torch.zeros(d.size(0))
    for g in range(d.size(0) // G):
        block = d[g * G:(g + 1) * G, g * G:(g + 1) * G]
        out[g * G:(g + 1) * G] = numer[g * G:(g + 1) * G] / torch.sqrt((block ** 2).sum() / (2 * G * (G - 1)) + eps)
    return out


def test_pairwise_rewards_match_the_official_advantage():
    torch.manual_seed(0)
    G, groups = 4, 3
    pairs = [(g * G + a, g * G + b, float(torch.randint(-3, 4, ()).item() or 1))
             for g in range(groups) for a in range(G) for b in range(a + 1, G)]
    d = pair_matrix(pairs, G * groups)
    torch.testing.assert_close(d, -d.T, equal_nan=True)  # antisymmetric
    assert torch.isnan(d[0, G]) and d[0, 0] == 0 and d[1, 0] == -d[0, 1]
    numer, scale = pairwise_rewards(d, G)
    torch.testing.assert_close(numer, torch.nansum(d, dim=1) / G)
    torch.testing.assert_close(numer / scale.repeat_interleave(G), official_advantage(d, G))


def test_win_rate_reading_and_missing_pairs():
    # binary verdicts in one group of 3: row 0 beats 1 and 2, row 1 beats 2
    d = pair_matrix([(0, 1, 1.0), (0, 2, 1.0), (1, 2, 1.0)], 3)
    numer, scale = pairwise_rewards(d, 3)
    assert numer.tolist() == pytest.approx([2 / 3, 0.0, -2 / 3])  # (wins - losses) / G
    assert scale.tolist() == pytest.approx([math.sqrt(0.5 + 1e-6)])
    # pair (0, 2) without a verdict: row 0 and 2 keep the mean of their judged pairs, scaled by (G-1)/G
    numer, _ = pairwise_rewards(pair_matrix([(0, 1, 1.0), (1, 2, 1.0)], 3), 3)
    assert numer.tolist() == pytest.approx([2 / 3, 0.0, -2 / 3])
    numer, scale = pairwise_rewards(pair_matrix([], 2), 2)  # nothing judged: 0, a finite scale
    assert numer.tolist() == [0.0, 0.0] and torch.isfinite(scale).all()


def _ctx(texts, G, weights=(0.0, 1.0)):
    N = len(texts)
    run = RunInfo(reward_func_names=("accuracy_reward", COLUMN))
    return make_reward_context(torch.zeros(N, 2), num_generations=G, reward_func_names=["accuracy_reward", COLUMN],
                               reward_weights=list(weights), run=run,
                               rows=[{"prompt": [{"role": "user", "content": PROBLEM.question}]}] * N,
                               completions=[[{"role": "assistant", "content": t}] for t in texts])


def _stack(**options):
    stack = build_plugins(["think_rm"], {"think_rm": {"genrm": "scripted", **options}})
    return stack, list(stack)[0]


def test_group_rewards_and_advantages_from_the_scripted_judge():
    stack, plugin = _stack()
    asked = []
    judge = plugin._build()
    original = judge.backend.ask
    judge.backend.ask = lambda convs: asked.extend(convs) or original(convs)
    plugin.grm = judge
    ctx = _ctx([RIGHT, WRONG, WORSE, RIGHT, WRONG, WRONG], 3)
    stack.call("trl_plugins_transform_rewards", ctx)
    column = ctx.rewards_per_func[:, 1]
    # group 0: RIGHT beats both, WRONG (first error at step 2) beats WORSE (error at step 1)
    assert column[:3].tolist() == pytest.approx([2 / 3, 0.0, -2 / 3])
    # group 1: RIGHT beats both; the WRONG-WRONG tie is read as "A" (position bias, no swap: official)
    assert column[3:].tolist() == pytest.approx([2 / 3, 0.0, -2 / 3])
    assert len(asked) == 6  # G(G-1)/2 pairs per group, once each
    adv = make_advantage_context(ctx.rewards_per_func @ torch.tensor([0.0, 1.0]), num_generations=3,
                                 rewards_per_func=ctx.rewards_per_func, run=ctx.run)
    stack.call("trl_plugins_transform_advantages", adv)
    expected = official_advantage(pair_matrix([(0, 1, 1.0), (0, 2, 1.0), (1, 2, 1.0),
                                               (3, 4, 1.0), (3, 5, 1.0), (4, 5, 1.0)], 6), 3)
    torch.testing.assert_close(adv.advantages, expected)


def test_position_swap_and_multiclass():
    stack, plugin = _stack(position_swap=True)
    ctx = _ctx([RIGHT, WRONG, WRONG, WRONG], 2)
    stack.call("trl_plugins_transform_rewards", ctx)
    assert ctx.rewards_per_func[:, 1].tolist() == pytest.approx([0.5, -0.5, 0.0, 0.0])  # the tie cancels out
    stack, plugin = _stack(verdict="multiclass")
    assert plugin._build().template is MULTICLASS_TEMPLATE
    ctx = _ctx([RIGHT, WRONG, WRONG, WRONG], 2)
    stack.call("trl_plugins_transform_rewards", ctx)
    assert ctx.rewards_per_func[:, 1].tolist() == pytest.approx([1.0, -1.0, 0.5, -0.5])  # +-2 / G, a tie is -1 (A)
    assert MULTICLASS_TEMPLATE.parse("<answer>-3</answer>") == -3 and MULTICLASS_TEMPLATE.parse("<answer>0</answer>") \
        is None
    assert BINARY_TEMPLATE.parse("thinking... <answer>B</answer>") == 1.0


def test_unparsable_pairs_are_counted_left_out_and_refused_past_the_share():
    def judge(messages):
        return "hmm, hard to say" if "Answer: 16" in messages[-1]["content"] else "<answer>A</answer>"

    stack, plugin = _stack()
    plugin.grm = GenerativeRewardModel(ScriptedGenRMBackend(judge), BINARY_TEMPLATE, k=1, aggregate="mean",
                                       max_unparsable=0.7, name="think_rm")
    ctx = _ctx([RIGHT, WRONG, WORSE], 3)
    stack.call("trl_plugins_transform_rewards", ctx)
    assert ctx.metrics["plugins/think_rm/unparsable_fraction"] == [pytest.approx(2 / 3)]
    # only (0, 1) was judged: rows 0 and 1 keep it (scaled by (G-1)/G), row 2 has no judged pair: 0, not a tie
    assert ctx.rewards_per_func[:, 1].tolist() == pytest.approx([2 / 3, -2 / 3, 0.0])
    plugin.grm.max_unparsable = 0.5
    with pytest.raises(GenRMParseError, match=r"'think_rm' at scripted.*2 of 2 samples.*hard to say"):
        stack.call("trl_plugins_transform_rewards", _ctx([RIGHT, WORSE, WRONG], 3))


def test_refusals():
    with pytest.raises(PluginConfigError, match="genrm_base_url"):
        build_plugins(["think_rm"], {"think_rm": {}})
    with pytest.raises(PluginConfigError, match="'both'"):
        build_plugins(["think_rm"], {"think_rm": {"genrm": "scripted", "verdict": "both"}})
    with pytest.raises(PluginConfigError, match="k"):
        build_plugins(["think_rm"], {"think_rm": {"genrm": "scripted", "k": 0}})
    _, plugin = _stack()
    trainer = SimpleNamespace(reward_func_names=["accuracy_reward", COLUMN], reward_weights=torch.tensor([1.0, 1.0]))
    with pytest.raises(PluginConfigError, match=r"accuracy_reward \(weight 1\).*advantage='trl'"):
        plugin.trl_plugins_configure(trainer=trainer, args=None)
    trainer.reward_weights = torch.tensor([0.0, 1.0])
    plugin.trl_plugins_configure(trainer=trainer, args=None)  # other columns weighted 0: accepted


def test_neutral_weight_zero_with_trl_advantages_matches_vanilla_grpo(tmp_path):
    common = dict(max_steps=1, reward_funcs=[accuracy_reward, digit_fraction_reward], output_dir=str(tmp_path),
                  log_level="error")
    vanilla = record_run(make_tiny_trainer(trainer_cls=trl.GRPOTrainer, **common))
    neutral = record_run(make_tiny_trainer(
        plugins=["think_rm"],
        plugin_config={"think_rm": {"genrm": "scripted", "advantage": "trl", "reward_weight": 0.0}}, **common))
    for a, b in zip(vanilla.rewards, neutral.rewards):
        assert b.shape[1] == a.shape[1] + 1 and torch.equal(a, b[:, :2])
    for a, b in zip(vanilla.advantages, neutral.advantages):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    for key in vanilla.params:
        torch.testing.assert_close(vanilla.params[key], neutral.params[key], atol=0, rtol=0)
    clear_shared_genrm_backends()


def test_trainer_run_uses_the_pairwise_advantages(tmp_path):
    clear_shared_genrm_backends()
    trainer = make_tiny_trainer(plugins=["think_rm"], plugin_config={"think_rm": {"genrm": "scripted"}},
                                reward_funcs=[accuracy_reward], reward_weights=[0.0], max_steps=2,
                                output_dir=str(tmp_path), log_level="error")
    script_generation(trainer, lambda prompt, row: row_from_question(prompt)["solution"] if row % 2 == 0
                      else "1+1=3\nAnswer: 3")
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    run_ = record_run(trainer)
    G = trainer.args.num_generations
    for rewards, advantages in zip(run_.rewards, run_.advantages):
        correct = rewards[:, 0] > 0.5
        pairs = [(a, b, 1.0 if correct[a] or not correct[b] else -1.0)  # the judge prefers the correct one, else A
                 for g in range(len(rewards) // G) for a in range(g * G, g * G + G) for b in range(a + 1, g * G + G)]
        d = pair_matrix(pairs, len(rewards))
        torch.testing.assert_close(rewards[:, 1], torch.nansum(d, dim=1) / G)
        torch.testing.assert_close(advantages.reshape(len(rewards), -1)[:, 0], official_advantage(d, G))
    logs = [log for log in run_.logs if "loss" in log]
    assert all("plugins/think_rm/pair_scale_mean" in log for log in logs)
    assert any(not torch.equal(before[n], p) for n, p in run_.params.items())
    clear_shared_genrm_backends()

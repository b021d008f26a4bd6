"""reasonflux_prm: ungated PRM process reward (ReasonFlux-PRM): the official trajectory column (whole response as
one step, beta = 0.75 mix), step aggregation, dense per-token advantages; neutral settings match vanilla TRL."""


import pytest
import torch
import trl

from trl_plugins import PluginConfigError, build_plugins
from trl_plugins.components.prm import STEP_VERIFIERS, FunctionPRM, clear_shared_prms
from trl_plugins.tasks.arithmetic import accuracy_reward
from trl_plugins.testing import (
    digit_fraction_reward,
    make_advantage_context,
    make_reward_context,
    make_tiny_trainer,
    record_run,
)
from trl_plugins_builtin.reasonflux_prm import COLUMN, aggregate_steps, column_weight, dense_process_advantages


class LengthPRM(FunctionPRM):
    """Step score = 1 / (number of characters of the step); records the step lists it saw."""

    def __init__(self):
        super().__init__(lambda row, steps: [1.0 / len(s) for s in steps], separator="\n")
        self.seen = []

    def _score_step_lists(self, questions, step_lists, rows):
        self.seen.extend(step_lists)
        return super()._score_step_lists(questions, step_lists, rows)


def _plugin(**options):
    stack = build_plugins(["reasonflux_prm"], {"reasonflux_prm": {"prm": "programmatic", **options}})
    return stack, list(stack)[0]


def _reward_ctx(texts, G, with_column=True):
    N = len(texts)
    cols = [torch.tensor([1.0, 0.0] * (N // 2))] + ([torch.zeros(N)] if with_column else [])
    names = ["accuracy_reward"] + ([COLUMN] if with_column else [])
    return make_reward_context(torch.stack(cols, dim=1), num_generations=G, reward_func_names=names,
                               rows=[{"prompt": "q"}] * N,
                               completions=[[{"role": "assistant", "content": t}] for t in texts])


def test_helpers():
    assert aggregate_steps([1.0, 0.5, 0.0], "mean") == 0.5 and aggregate_steps([], "min") == 0.0
    assert aggregate_steps([1.0, 0.5], "last") == 0.5 and aggregate_steps([0.5, 0.5], "prod") == 0.25
    assert column_weight(0.75) == 3.0 and column_weight(0.0) == 0.0
    # official mix 0.75 * prm + 0.25 * outcome is (weight-3 column + outcome) / 4: same group-standardised advantage
    prm, outcome = torch.tensor([0.2, 0.9, 0.5, 0.4]), torch.tensor([1.0, 0.0, 0.0, 1.0])
    official, ours = 0.75 * prm + 0.25 * outcome, column_weight(0.75) * prm + outcome
    z = lambda r: (r - r.mean()) / r.std()  # noqa: E731
    torch.testing.assert_close(z(official), z(ours))


def test_trajectory_column_scores_the_whole_response_as_one_step():
    stack, plugin = _plugin()
    plugin.prm = prm = LengthPRM()
    ctx = _reward_ctx(["ab\ncd", "abcd", "a", "  "], 2)
    stack.call("trl_plugins_transform_rewards", ctx)
    assert prm.seen == [["ab\ncd"], ["abcd"], ["a"]]  # one step per response; an empty response is not sent
    torch.testing.assert_close(ctx.rewards_per_func[:, 1], torch.tensor([1 / 5, 1 / 4, 1.0, 0.0]))
    assert ctx.rewards_per_func[:, 0].tolist() == [1.0, 0.0, 1.0, 0.0]  # outcome untouched, no gate
    assert ctx.metrics["plugins/reasonflux_prm/process_reward_mean"] == [pytest.approx((0.2 + 0.25 + 1.0) / 4)]


def test_steps_granularity_aggregates_step_scores():
    stack, plugin = _plugin(granularity="steps", aggregate="min")
    plugin.prm = prm = LengthPRM()
    ctx = _reward_ctx(["ab\ncd", "abcd\na"], 2)
    stack.call("trl_plugins_transform_rewards", ctx)
    assert prm.seen == [["ab", "cd"], ["abcd", "a"]]
    torch.testing.assert_close(ctx.rewards_per_func[:, 1], torch.tensor([0.5, 0.25]))


def test_dense_process_advantages_formula():
    scores = [[1.0, 0.0], [0.5], [0.2], []]
    ends = [[2, 4], [3], [1], []]
    out = dense_process_advantages(scores, ends, group_size=2, width=5, eps=0.0)
    values = torch.tensor([1.0, 0.0, 0.5])
    mean, std = values.mean(), values.std()
    r = (values - mean) / std
    torch.testing.assert_close(out[0], torch.stack([r[0] + r[1]] * 2 + [r[1]] * 2 + [torch.tensor(0.0)]))
    torch.testing.assert_close(out[1], torch.stack([r[2]] * 3 + [torch.tensor(0.0)] * 2))
    torch.testing.assert_close(out[2], torch.tensor([0.0, 0, 0, 0, 0]))  # one step in the group: std 1, z = 0
    torch.testing.assert_close(out[3], torch.zeros(5))


def test_dense_mode_adds_per_token_advantages():
    stack, plugin = _plugin(mode="dense", dense_weight=0.5)
    plugin.prm = LengthPRM()
    texts = ["ab\ncd", "abcd", "a\nbb", "c"]
    rctx = _reward_ctx(texts, 2, with_column=False)
    stack.call("trl_plugins_transform_rewards", rctx)
    steps = [s for s, _ in plugin._batch]
    ends = [e for _, e in plugin._batch]
    assert steps == [[0.5, 0.5], [0.25], [1.0, 0.5], [1.0]]
    assert ends == [[2, 5], [4], [1, 4], [1]]  # char tokens: the token just after each step
    actx = make_advantage_context(torch.tensor([1.0, 0.0, 1.0, 0.0]), num_generations=2,
                                  completion_lengths=[5, 4, 4, 1])
    before = actx.advantages.clone()
    stack.call("trl_plugins_transform_advantages", actx)
    mask = actx.completion_mask().float()
    expected = before.unsqueeze(1) + 0.5 * dense_process_advantages(steps, ends, 2, mask.size(1)) * mask
    assert actx.advantages.shape == mask.shape
    torch.testing.assert_close(actx.advantages, expected.to(actx.advantages.dtype))
    assert not torch.equal(actx.advantages, before.unsqueeze(1).expand_as(mask))


def test_dense_mode_refuses_an_unrecorded_batch():
    stack, _ = _plugin(mode="dense")
    with pytest.raises(Exception, match="did not record"):
        stack.call("trl_plugins_transform_advantages",
                   make_advantage_context(torch.tensor([1.0, 0.0]), num_generations=2))


@pytest.mark.parametrize("options, match", [
    ({"beta": 1.0}, "beta"), ({"beta": -0.1}, "beta"), ({"mode": "sparse"}, "mode"),
    ({"granularity": "token"}, "granularity"), ({"aggregate": "max"}, "aggregate"),
    ({"dense_weight": -1.0}, "dense_weight"), ({"eps": 0.0}, "eps"),
])
def test_bad_options_are_refused(options, match):
    with pytest.raises(PluginConfigError, match=match):
        build_plugins(["reasonflux_prm"], {"reasonflux_prm": {"prm": "programmatic", **options}})


def test_declarations():
    _, plugin = _plugin()
    assert isinstance(plugin.image_inputs, str) and plugin.image_inputs.endswith(".")
    assert isinstance(plugin.multi_turn, str)
    assert plugin.required_columns() == ["problem"]
    assert plugin.official.repository == "CloudEngineHub/ReasonFlux"


@pytest.mark.parametrize("options", [{"beta": 0.0}, {"mode": "dense", "dense_weight": 0.0}])
def test_neutral_settings_match_vanilla_grpo(tmp_path, options):
    common = dict(max_steps=1, reward_funcs=[accuracy_reward, digit_fraction_reward], output_dir=str(tmp_path),
                  log_level="error")
    vanilla = record_run(make_tiny_trainer(trainer_cls=trl.GRPOTrainer, **common))
    neutral = record_run(make_tiny_trainer(
        plugins=["reasonflux_prm"], plugin_config={"reasonflux_prm": {"prm": "programmatic", **options}}, **common))
    for a, b in zip(vanilla.completion_ids, neutral.completion_ids):
        assert torch.equal(a, b)
    for a, b in zip(vanilla.advantages, neutral.advantages):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    torch.testing.assert_close(torch.tensor(vanilla.losses), torch.tensor(neutral.losses), atol=0, rtol=0)


def test_trainer_runs_both_modes(tmp_path):
    for i, options in enumerate([{}, {"mode": "dense"}]):
        trainer = make_tiny_trainer(
            plugins=["reasonflux_prm"], plugin_config={"reasonflux_prm": {"prm": "programmatic", **options}},
            max_steps=1, reward_funcs=[accuracy_reward], output_dir=str(tmp_path / str(i)), log_level="error")
        run = record_run(trainer)
        logs = {k for entry in trainer.state.log_history for k in entry}
        assert "plugins/reasonflux_prm/process_reward_mean" in logs
        if options:
            assert run.advantages[0].dim() == 2
        else:
            assert run.rewards[0].shape[1] == 2


def test_fin_prm_mode_outcome_weighted_zero_leaves_the_prm_alone(tmp_path):
    """Fin-PRM's official RL reward is the PRM score alone: the outcome columns weighted 0 (TRL's reward_weights)."""
    STEP_VERIFIERS.register("reasonflux_test_length", lambda problem, steps: [1.0 / (1 + len(s)) for s in steps],
                            replace=True)
    trainer = make_tiny_trainer(
        plugins=["reasonflux_prm"],
        plugin_config={"reasonflux_prm": {"prm": "programmatic", "prm_verifier": "reasonflux_test_length"}},
        max_steps=1, reward_funcs=[accuracy_reward], reward_weights=[0.0], output_dir=str(tmp_path), log_level="error")
    run = record_run(trainer)
    clear_shared_prms()
    G = trainer.num_generations
    assert any(r[:, 1].view(-1, G).std(1).gt(0).any() for r in run.rewards), "the PRM column has no variance"
    for rewards, advantages in zip(run.rewards, run.advantages):
        prm = column_weight(0.75) * rewards[:, 1].view(-1, G)  # the combined reward: the PRM column alone
        expected = ((prm - prm.mean(1, keepdim=True)) / (prm.std(1, keepdim=True) + 1e-4)).view(-1)
        torch.testing.assert_close(advantages.float(), expected.float(), atol=1e-5, rtol=1e-5)

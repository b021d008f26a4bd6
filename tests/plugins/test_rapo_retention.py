"""rapo_retention (RaPO, arXiv:2605.09640): the retention reward against the previous task's policy and the cross-task
EMA advantage normalisation (CTAN). Formulas on small tensors (CTAN across steps and across a task boundary), the
reward column against stubbed log-probs, the neutral settings against vanilla TRL, a run against a saved tiny previous
policy, and the refusals."""

import json
import math

import pytest
import torch
import trl

from trl_plugins import PluginConfigError, build_plugins
from trl_plugins.api.errors import PluginError
from trl_plugins.components.teacher import clear_shared_teachers
from trl_plugins.tasks.arithmetic import accuracy_reward
from trl_plugins.tasks.tiny import build_and_save
from trl_plugins.testing import (
    digit_fraction_reward,
    make_advantage_context,
    make_reward_context,
    make_tiny_trainer,
    record_run,
)
from trl_plugins_builtin.rapo_retention import (
    COLUMN,
    CrossTaskNormalizer,
    RapoRetentionOptions,
    read_state_file,
    retention_reward,
)

GROUPS = torch.tensor([0, 0, 1, 1])
EPS = 1e-6


@pytest.fixture(autouse=True)
def _fresh_teachers():
    yield
    clear_shared_teachers()


def _plugin(**options):
    return list(_stack(**options))[0]


def _stack(**options):
    return build_plugins(["rapo_retention"], {"rapo_retention": {"teacher_model": "unused", **options}})


def _std(values):
    return torch.tensor(values, dtype=torch.float64).std().item()


# ------------------------------------------------------------------------------------------------ formulas
def test_retention_reward_is_exp_of_the_one_sided_mean_drift():
    policy = torch.tensor([[-1.0, -2.0, -7.0], [-0.5, -0.2, 0.0], [-1.0, -1.0, -1.0]])
    previous = torch.tensor([[-1.5, -1.0, -0.1], [-1.0, -1.0, -3.0], [-2.0, -2.0, -2.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 0], [0, 0, 0]])
    drift, reward = retention_reward(policy, previous, mask, alpha=2.0)
    # row 0: (0.5 - 1.0) / 2 < 0 -> 0 (moving towards the previous policy is not penalised; the masked token ignored)
    # row 1: (0.5 + 0.8) / 2 = 0.65; row 2: no token -> 0
    torch.testing.assert_close(drift, torch.tensor([0.0, 0.65, 0.0]))
    torch.testing.assert_close(reward, torch.tensor([1.0, math.exp(-1.3), 1.0]))


def test_ctan_reseeds_from_the_previous_task_and_warms_the_decay_up():
    o1 = RapoRetentionOptions(task_index=1)
    task1 = CrossTaskNormalizer(o1)
    task1.observe(torch.tensor([1.0, 0.0, 1.0, 1.0], dtype=torch.float64))
    state = task1.state_dict()
    assert state["last_batch_reward_mean"] == pytest.approx(0.75) and state["last_batch_reward_std"] == pytest.approx(0.5)
    assert state["update_count"] == 0 and state["ema_std"] == 1.0  # task 1 only records the batch

    task2 = CrossTaskNormalizer(RapoRetentionOptions(teacher_model="x"), state)
    assert task2.ema_std == pytest.approx(0.5) and not task2.fresh_start  # reseeded from task 1's last batch
    r1 = torch.tensor([1.0, 0.0, 0.5, 0.5], dtype=torch.float64)
    adv, fallback, std = task2.advantages(r1, GROUPS)
    s1 = 0.9 * 0.5 + 0.1 * _std([1.0, 0.0, 0.5, 0.5])  # first update of the task: decay 0.9
    assert std == pytest.approx(s1)
    torch.testing.assert_close(adv, torch.tensor([0.5, -0.5, 0.0, 0.0], dtype=torch.float64) / (s1 + EPS))
    assert not fallback.any()

    r2 = torch.tensor([2.0, 0.0, 1.0, 1.0], dtype=torch.float64)
    adv, _, std = task2.advantages(r2, GROUPS)
    b2 = 0.9 + (0.999 - 0.9) * 1 / 2  # halfway through the two warm-up updates
    s2 = b2 * s1 + (1 - b2) * _std([2.0, 0.0, 1.0, 1.0])
    assert std == pytest.approx(s2)
    torch.testing.assert_close(adv, torch.tensor([1.0, -1.0, 0.0, 0.0], dtype=torch.float64) / (s2 + EPS))

    adv, _, std = task2.advantages(r1, GROUPS)
    s3 = 0.999 * s2 + 0.001 * _std([1.0, 0.0, 0.5, 0.5])  # warmed up: the full decay
    assert std == pytest.approx(s3)
    assert task2.state_dict()["update_count"] == 3

    task3 = CrossTaskNormalizer(RapoRetentionOptions(teacher_model="x", task_index=3), task2.state_dict())
    assert task3.ema_std == pytest.approx(_std([1.0, 0.0, 0.5, 0.5]))  # the next task reseeds from this last batch
    assert task3.effective_beta() == pytest.approx(0.9)  # and warms up again


def test_ctan_guard_rail_falls_back_to_the_group_std():
    state = {"ema_mean": 0.0, "ema_std": 1.0, "update_count": 0, "last_batch_reward_mean": 0.5,
             "last_batch_reward_std": 0.01}
    ctan = CrossTaskNormalizer(RapoRetentionOptions(teacher_model="x"), state)
    adv, fallback, _ = ctan.advantages(torch.tensor([1.0, 0.0, 0.5, 0.5], dtype=torch.float64), GROUPS)
    # EMA std 0.9 * 0.01 + 0.1 * 0.408 = 0.05: group 0's advantages would be +-10 > 5, so it uses its own std
    assert fallback.tolist() == [True, True, False, False]
    torch.testing.assert_close(adv, torch.tensor([0.5, -0.5, 0.0, 0.0], dtype=torch.float64) / (_std([1.0, 0.0]) + EPS))
    off = CrossTaskNormalizer(RapoRetentionOptions(teacher_model="x", ctan_guard_abs_max=0.0), state)
    adv, fallback, std = off.advantages(torch.tensor([1.0, 0.0, 0.5, 0.5], dtype=torch.float64), GROUPS)
    assert not fallback.any() and adv[0].item() == pytest.approx(0.5 / (std + EPS)) and adv[0] > 5


def test_ctan_fresh_start_seeds_from_the_first_batch_with_the_official_bias_correction():
    ctan = CrossTaskNormalizer(RapoRetentionOptions(teacher_model="x"))
    r1 = torch.tensor([1.0, 0.0, 0.5, 0.5], dtype=torch.float64)
    adv, _, std = ctan.advantages(r1, GROUPS)
    assert std == pytest.approx(_std([1.0, 0.0, 0.5, 0.5]))  # t = 0: no correction
    adv, fallback, std = ctan.advantages(torch.tensor([2.0, 0.0, 1.0, 1.0], dtype=torch.float64), GROUPS)
    # t = 1: (s - 0.999) / 0.001 < 0 -> the 1e-3 floor, so group 0 falls back to its own std
    assert std == pytest.approx(1e-3)
    assert fallback.tolist() == [True, True, False, False]
    assert adv[0].item() == pytest.approx(1.0 / (_std([2.0, 0.0]) + EPS))
    plain = CrossTaskNormalizer(RapoRetentionOptions(teacher_model="x", ctan_bias_correction=False))
    plain.advantages(r1, GROUPS)
    assert plain.advantages(torch.tensor([2.0, 0.0, 1.0, 1.0], dtype=torch.float64), GROUPS)[2] > 0.3


# ------------------------------------------------------------------------------------------------ the hooks
class _Previous:
    """A previous-task policy answering fixed per-token log-probs (its prompt is ignored)."""

    def __init__(self, values):
        self.values, self.calls = values, 0

    def logprobs(self, prompt_ids, completion_ids):
        self.calls += 1
        return [torch.tensor(self.values[i][: len(c)]) for i, c in enumerate(completion_ids)]


def _reward_ctx(policy):
    ids = [[5, 6], [7, 8], [9], [10, 11]]
    return make_reward_context(torch.tensor([[1.0, 0.0], [0.0, 0.0], [1.0, 0.0], [0.0, 0.0]]), num_generations=2,
                               reward_func_names=["accuracy_reward", COLUMN], local_completion_ids=ids,
                               policy_logprobs=lambda p, c: [torch.tensor(policy[i][: len(x)]) for i, x in enumerate(c)])


def test_the_column_is_the_retention_reward_of_each_completion():
    policy = [[-0.5, -0.2], [-1.0, -1.0], [-0.1], [-2.0, -0.1]]
    previous = [[-1.0, -1.0], [-0.5, -0.5], [-0.3], [-1.0, -1.0]]
    ctx = _reward_ctx(policy)
    stack = _stack()
    plugin = list(stack)[0]
    plugin.teacher = _Previous(previous)
    stack.call("trl_plugins_transform_rewards", ctx)
    drifts = [0.65, 0.0, 0.2, max(0.0, (-1.0 + 0.9) / 2)]
    torch.testing.assert_close(ctx.rewards_per_func[:, 1], torch.tensor([math.exp(-20 * d) for d in drifts]))
    assert ctx.rewards_per_func[:, 0].tolist() == [1.0, 0.0, 1.0, 0.0]  # the task column untouched
    assert ctx.metrics["plugins/rapo_retention/retention_drift"][0] == pytest.approx(sum(drifts) / 4)
    assert plugin.teacher.calls == 1


def test_a_previous_policy_returning_no_log_probability_is_refused_with_the_row():
    ctx = _reward_ctx([[-0.5, -0.2], [-1.0, -1.0], [-0.1], [-2.0, -0.1]])
    plugin = _plugin()
    plugin.teacher = _Previous([[-1.0, -1.0], [-0.5, 0.5], [-0.3], [-1.0, -1.0]])
    with pytest.raises(PluginError, match="0.5 for completion token 1 of row 1"):
        plugin.trl_plugins_transform_rewards(ctx)


def test_the_advantage_hook_carries_ctan_across_tasks_through_the_state_file(tmp_path):
    path = str(tmp_path / "ctan.json")
    task1 = _plugin(task_index=1, ctan_state_file=path)
    ctx = make_advantage_context(torch.tensor([1.0, 0.0, 1.0, 1.0]), num_generations=2)
    trl_advantages = ctx.advantages.clone()
    task1.trl_plugins_transform_advantages(ctx)
    assert torch.equal(ctx.advantages, trl_advantages)  # task 1: TRL's advantages, statistics recorded
    assert json.loads(open(path).read())["last_batch_reward_std"] == pytest.approx(0.5)

    stack = _stack(ctan_state_file=path)  # reads the file at construction
    task2 = list(stack)[0]
    ctx = make_advantage_context(torch.tensor([1.0, 0.0, 0.5, 0.5]), num_generations=2)
    stack.call("trl_plugins_transform_advantages", ctx)
    s1 = 0.9 * 0.5 + 0.1 * _std([1.0, 0.0, 0.5, 0.5])
    torch.testing.assert_close(ctx.advantages, torch.tensor([0.5, -0.5, 0.0, 0.0]) / (s1 + EPS))
    assert ctx.metrics["plugins/rapo_retention/ctan_std"][0] == pytest.approx(s1)
    assert read_state_file(path)["update_count"] == 1
    resumed = _plugin(ctan_state_file=path)
    resumed.trl_plugins_load_state_dict(task2.trl_plugins_state_dict())  # a checkpoint restores the same statistics
    assert resumed.ctan.state_dict() == task2.ctan.state_dict()
    eval_ctx = make_advantage_context(torch.tensor([1.0, 0.0, 0.5, 0.5]), num_generations=2, mode="eval")
    task2.trl_plugins_transform_advantages(eval_ctx)
    assert read_state_file(path)["update_count"] == 1  # evaluation batches do not move the statistics


@pytest.mark.parametrize(("options", "message"), [
    ({"teacher_model": "default"}, "needs teacher_model"),
    ({"teacher": "endpoint"}, "base"),
    ({"retention_lambda": -0.5}, "retention_lambda"),
    ({"retention_alpha": -1.0}, "retention_alpha"),
    ({"task_index": 0}, "task_index"),
    ({"ctan_beta": 1.5}, "ctan_beta"),
    ({"ctan_min_std": 0.0}, "ctan_min_std"),
    ({"ctan": False, "ctan_state_file": "x.json"}, "only used with ctan=True"),
])
def test_bad_options_are_refused_at_construction(options, message):
    with pytest.raises(PluginConfigError, match=message):
        build_plugins(["rapo_retention"], {"rapo_retention": {"teacher_model": "unused", **options}})


@pytest.mark.parametrize(("content", "message"), [
    ("{not json", "cannot be read as JSON"),
    ('{"ema_mean": 0, "ema_std": "wide", "update_count": 0}', "ema_std='wide'"),
    ("[1, 2]", "not a JSON object"),
])
def test_a_state_file_that_is_not_ctan_statistics_is_refused_at_construction(tmp_path, content, message):
    path = tmp_path / "ctan.json"
    path.write_text(content)
    with pytest.raises(PluginConfigError, match=message):
        _plugin(ctan_state_file=str(path))


def test_the_first_task_needs_no_previous_policy():
    plugin = list(build_plugins(["rapo_retention"], {"rapo_retention": {"task_index": 1}}))[0]
    assert not plugin.hook_enabled("trl_plugins_transform_rewards") and plugin.overwritten() == ()
    assert plugin.trl_plugins_reward_functions(None) == []  # no retention column on the first task


# ------------------------------------------------------------------------------------------------ tiny runs
COMMON = dict(max_steps=1, reward_funcs=[accuracy_reward, digit_fraction_reward], log_level="error")


@pytest.fixture(scope="module")
def vanilla(tmp_path_factory):
    out = tmp_path_factory.mktemp("vanilla")
    return record_run(make_tiny_trainer(trainer_cls=trl.GRPOTrainer, output_dir=str(out), **COMMON))


def test_neutral_settings_match_vanilla_grpo(tmp_path, vanilla):
    path = str(tmp_path / "ctan.json")
    runs = [
        record_run(make_tiny_trainer(plugins=["rapo_retention"], output_dir=str(tmp_path / "n"), plugin_config={
            "rapo_retention": {"teacher_model": "unused", "retention_lambda": 0.0, "ctan": False}}, **COMMON)),
        # the first task of a sequence: no previous policy, CTAN only records the statistics for the next task
        record_run(make_tiny_trainer(plugins=["rapo_retention"], output_dir=str(tmp_path / "t1"), plugin_config={
            "rapo_retention": {"task_index": 1, "ctan_state_file": path}}, **COMMON)),
    ]
    for run in runs:
        for a, b in zip(vanilla.rewards, run.rewards):
            torch.testing.assert_close(a, b, atol=0, rtol=0)
        for a, b in zip(vanilla.advantages, run.advantages):
            torch.testing.assert_close(a, b, atol=0, rtol=0)
        for key in vanilla.params:
            torch.testing.assert_close(vanilla.params[key], run.params[key], atol=0, rtol=0)
    state = read_state_file(path)
    assert state["update_count"] == 0 and state["last_batch_reward_std"] is not None


def test_a_later_task_scores_drift_from_the_saved_previous_policy_and_uses_ctan(tmp_path, vanilla):
    previous = str(build_and_save(tmp_path / "task1", seed=3, hidden_size=16, num_layers=1, num_heads=2))
    path = tmp_path / "ctan.json"
    path.write_text(json.dumps({"ema_mean": 0.0, "ema_std": 1.0, "update_count": 0, "last_batch_reward_mean": 0.5,
                                "last_batch_reward_std": 0.4}))
    run = record_run(make_tiny_trainer(plugins=["rapo_retention"], output_dir=str(tmp_path / "t2"), plugin_config={
        "rapo_retention": {"teacher_model": previous, "ctan_state_file": str(path)}}, **COMMON))
    for a, b in zip(vanilla.rewards, run.rewards):
        assert b.shape[1] == a.shape[1] + 1 and torch.equal(a, b[:, :2])
        assert ((b[:, 2] > 0) & (b[:, 2] <= 1)).all() and (b[:, 2] < 1).any()  # another model: some drift
    assert any(not torch.equal(a, b) for a, b in zip(vanilla.advantages, run.advantages))
    assert read_state_file(str(path))["update_count"] == len(run.advantages)
    logs = [log for log in run.logs if "loss" in log]
    assert logs and all(f"plugins/rapo_retention/{k}" in log for k in ("retention_drift", "ctan_std") for log in logs)

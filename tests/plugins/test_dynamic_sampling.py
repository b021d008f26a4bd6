"""dynamic_sampling (DAPO): which groups the criteria reject, success on the verifier column, fresh groups only,
bad options refused, and an end-to-end run that refills the batch within the step."""

import pytest
import torch

from trl_plugins import PluginConfigError, build_plugins
from trl_plugins.api.services import RunInfo
from trl_plugins.testing import make_refill_context, make_tiny_trainer, record_run, run_hook

HOOK = "trl_plugins_reject_groups"
RUN = RunInfo(reward_func_names=("accuracy", "format"))


def _ctx(values, **kw):
    return make_refill_context(values, num_generations=4, run=RUN, **kw)


def test_accuracy_criterion_rejects_all_correct_and_all_wrong_groups_on_the_verifier_column():
    # verifier column: group 0 all wrong, group 1 mixed, group 2 all correct; the format column varies everywhere
    acc = torch.tensor([0, 0, 0, 0, 1, 0, 1, 0, 1, 1, 1, 1], dtype=torch.float32)
    fmt = torch.tensor([0.5, 0.1, 0.2, 0.3] * 3)
    ctx = run_hook("dynamic_sampling", HOOK, _ctx(torch.stack([acc, fmt], 1)))
    assert ctx.rejected.tolist() == [True, False, True]
    assert ctx.metrics["plugins/dynamic_sampling/filtered_fraction"] == [pytest.approx(2 / 3)]
    assert ctx.replacements == []  # refilled from the trainer's stream


def test_reward_std_criterion_reads_the_combined_reward():
    acc = torch.tensor([0, 0, 0, 0, 1, 0, 1, 0, 1, 1, 1, 1], dtype=torch.float32)
    fmt = torch.tensor([0.5, 0.1, 0.2, 0.3] + [0.5] * 8)
    ctx = run_hook("dynamic_sampling", HOOK, _ctx(torch.stack([acc, fmt], 1)),
                   {"dynamic_sampling": {"criterion": "reward_std"}})
    assert ctx.rejected.tolist() == [False, False, True]  # group 0 varies through the format column


def test_success_threshold_and_column_options_decide_accuracy():
    partial = torch.tensor([0.6] * 4 + [0.4] * 4)  # a partial-credit column: success above the threshold only
    ctx = make_refill_context(torch.stack([partial, partial], 1), num_generations=4,
                              run=RunInfo(reward_func_names=("partial", "other")))
    run_hook("dynamic_sampling", HOOK, ctx, {"dynamic_sampling": {"success_threshold": 0.5}})
    assert ctx.rejected.tolist() == [True, True]  # all above / all below 0.5
    other = torch.tensor([1.0, 0.0] * 4)  # the named verifier column: mixed in both groups
    ctx = make_refill_context(torch.stack([partial, other], 1), num_generations=4,
                              run=RunInfo(reward_func_names=("partial", "other")))
    run_hook("dynamic_sampling", HOOK, ctx, {"dynamic_sampling": {"success_column": "other"}})
    assert ctx.rejected.tolist() == [False, False]

def test_only_fresh_groups_are_judged():
    values = torch.zeros(8)  # two all-wrong groups
    ctx = run_hook("dynamic_sampling", HOOK, make_refill_context(values, num_generations=4, round=1,
                                                                 fresh=[False, True]))
    assert ctx.rejected.tolist() == [False, True]


@pytest.mark.parametrize("options, match", [
    ({"criterion": "variance"}, "criterion"),
    ({"std_tolerance": -0.1}, "std_tolerance"),
])
def test_bad_options_are_refused(options, match):
    with pytest.raises(PluginConfigError, match=match):
        build_plugins(["dynamic_sampling"], {"dynamic_sampling": options})


def test_end_to_end_every_trained_group_has_mixed_success():
    """Groups of 2 on the untrained tiny model: many are all-wrong; with enough refill rounds the trained batch holds
    only mixed groups (or the limit was reached, which the metrics say)."""

    def coin(completions, **kwargs):  # deterministic per completion text, ~half successes
        return [float(sum(map(ord, c if isinstance(c, str) else c[-1]["content"])) % 2) for c in completions]

    trainer = make_tiny_trainer(plugins=["dynamic_sampling"], reward_funcs=[coin], num_generations=2,
                                per_device_train_batch_size=4, max_steps=2, max_refill_rounds=6)
    run = record_run(trainer)
    logs = {k: v for log in run.logs for k, v in log.items()}
    for rewards in run.rewards:
        rate = rewards[:, 0].view(-1, 2).mean(1)
        mixed = (rate > 0) & (rate < 1)
        assert mixed.all() or logs["plugins/framework/kept_at_limit"] > 0
    assert trainer.generation_service.total == sum(
        log.get("plugins/framework/refill_rollouts", 0) for log in run.logs if "loss" in log
    )

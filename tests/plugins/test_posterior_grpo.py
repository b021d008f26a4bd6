"""posterior_grpo: success-gated PRM process reward (Posterior-GRPO) and the Trust-GRPO mode (SophiaVL-R1).
Transform tests on hand-built RewardContexts; trainer runs check the reward column, the
neutral setting and the stack with scope sharing one PRM instance."""

import math
from types import SimpleNamespace

import pytest
import torch
import trl

from trl_plugins import PluginConfigError, build_plugins
from trl_plugins.components.prm import FunctionPRM, ProgrammaticPRM, clear_shared_prms
from trl_plugins.api.services import RunInfo
from trl_plugins.tasks.arithmetic import accuracy_reward
from trl_plugins.api.errors import PluginError
from trl_plugins.testing import (
    digit_fraction_reward,
    make_reward_context,
    make_tiny_trainer,
    record_run,
    run_on_processes,
)
from trl_plugins_builtin.posterior_grpo import COLUMN, aggregate_scores, trust_weights


def test_aggregate_and_trust_weights():
    assert aggregate_scores([1.0, 0.5, 0.0], "mean") == 0.5
    assert aggregate_scores([1.0, 0.5], "min") == 0.5 and aggregate_scores([1.0, 0.5], "last") == 0.5
    assert aggregate_scores([0.5, 0.5], "prod") == 0.25 and aggregate_scores([], "mean") == 0.0
    process = torch.tensor([0.9, 0.1, 0.2, 0.8, 0.5, 0.5, 0.4, 0.4])
    correct = torch.tensor([True, False, True, False, True, True, False, False])
    w = trust_weights(process, correct, 2)
    assert w[:2].tolist() == [1.0, 1.0]  # correct rollouts get the higher process reward: trusted
    torch.testing.assert_close(w[2:4], torch.full((2,), math.exp(0.2 - 0.8)))  # reversed: down-weighted
    assert w[4:].tolist() == [0.0] * 4  # one side empty: no process reward (official SophiaVL-R1)
    assert trust_weights(process, correct, 2, one_sided=1.0)[4:].tolist() == [1.0] * 4  # trust_one_sided="full"


class CountingPRM(FunctionPRM):
    def __init__(self):
        super().__init__(lambda row, steps: [0.5 + 0.5 * (k % 2) for k in range(len(steps))], separator="\n")
        self.seen = []

    def score_steps(self, rows, completions):
        self.seen.extend(completions)
        return super().score_steps(rows, completions)


def _reward_ctx(outcome, texts, G, step=0, **processes):
    N = len(outcome)
    matrix = torch.stack([torch.tensor(outcome, dtype=torch.float32), torch.zeros(N)], dim=1)
    return make_reward_context(matrix, num_generations=G, reward_func_names=["accuracy_reward", COLUMN],
                               rows=[{"prompt": "q"}] * N, step=step,
                               completions=[[{"role": "assistant", "content": t}] for t in texts], **processes)


def _run(ctx, prm, **options):
    stack = build_plugins(["posterior_grpo"], {"posterior_grpo": {"prm": "programmatic", **options}})
    plugin = list(stack)[0]
    plugin.prm = prm
    plugin._max_steps = 10
    stack.call("trl_plugins_transform_rewards", ctx)
    return ctx


def test_process_reward_only_for_correct_outcomes():
    prm = CountingPRM()
    texts = ["a\nb", "a\nb\nc", "a", "x\ny"]
    ctx = _run(_reward_ctx([1.0, 0.0, 1.0, 0.0], texts, 2), prm)
    assert prm.seen == ["a\nb", "a"]  # only correct rollouts are sent to the PRM
    assert ctx.rewards_per_func[:, 1].tolist() == [0.75, 0.0, 0.5, 0.0]  # mean of [0.5, 1.0]; [0.5]
    assert ctx.rewards_per_func[:, 0].tolist() == [1.0, 0.0, 1.0, 0.0]  # the outcome column is untouched
    assert ctx.metrics["plugins/posterior_grpo/paid_fraction"] == [0.5]
    assert ctx.metrics["plugins/posterior_grpo/process_reward_mean"] == [0.625]


def test_trust_mode_weights_and_anneals_every_rollout():
    prm = CountingPRM()
    texts = ["a", "a\nb", "a\nb", "a"]  # process: 0.5, 0.75, 0.75, 0.5
    ctx = _run(_reward_ctx([1.0, 0.0, 0.0, 1.0], texts, 2, step=5), prm, mode="trust", trust_min_outcome=None)
    assert len(prm.seen) == 4
    factor = math.exp(-5 / 10)
    trust = math.exp(0.5 - 0.75)  # the wrong rollout of each group got the higher process reward
    torch.testing.assert_close(ctx.rewards_per_func[:, 1],
                               torch.tensor([0.5, 0.75, 0.75, 0.5]) * trust * factor)
    assert ctx.metrics["plugins/posterior_grpo/anneal_factor"] == [pytest.approx(factor)]
    ctx = _run(_reward_ctx([1.0, 0.0], ["a", "a"], 2, step=5), CountingPRM(), mode="trust", anneal="none",
               trust_min_outcome=None)
    assert ctx.rewards_per_func[:, 1].tolist() == [0.5, 0.5]


class FailingPRM(CountingPRM):
    def score_steps(self, rows, completions):
        raise ConnectionError("PRM endpoint down")


def _two_process_outcomes(prms):
    """The 4-row batch of test_process_reward_only_for_correct_outcomes split over 2 simulated processes (2 rows each;
    one PRM per process); per process the reward column or the exception it raised."""
    outcome, texts = [1.0, 0.0, 1.0, 0.0], ["a\nb", "a\nb\nc", "a", "x\ny"]

    def work(rank, gather):
        ctx = _reward_ctx(outcome, texts, 2, num_processes=2, process_index=rank, gather=gather)
        try:
            return _run(ctx, prms[rank]).rewards_per_func[:, 1].tolist()
        except Exception as exc:  # returned, so every process's outcome can be checked
            return exc

    return run_on_processes(2, work, timeout=10)


def test_two_processes_give_the_one_process_rewards():
    assert _two_process_outcomes([CountingPRM(), CountingPRM()]) == [[0.75, 0.0, 0.5, 0.0]] * 2


def test_prm_failing_on_one_process_stops_both_without_a_hang():
    first, second = _two_process_outcomes([CountingPRM(), FailingPRM()])
    assert isinstance(second, ConnectionError) and "PRM endpoint down" in str(second)
    assert isinstance(first, PluginError) and "posterior_grpo: process 1 failed" in str(first)


def test_options_and_construction(tmp_path):
    with pytest.raises(PluginConfigError, match="prm_base_url"):
        build_plugins(["posterior_grpo"], {"posterior_grpo": {"prm": "endpoint"}})
    plugin = list(build_plugins(["posterior_grpo"], {"posterior_grpo": {"prm": "programmatic",
                                                                         "outcome_reward": "nope"}}))[0]
    trainer = SimpleNamespace(reward_func_names=["accuracy_reward", COLUMN])
    with pytest.raises(PluginConfigError, match="'nope' is not a reward function"):
        plugin.trl_plugins_configure(trainer=trainer, args=SimpleNamespace(max_steps=3))
    plugin = list(build_plugins(["posterior_grpo"], {"posterior_grpo": {"prm": "programmatic"}}))[0]
    with pytest.raises(PluginConfigError, match="outcome reward"):
        plugin.trl_plugins_configure(trainer=SimpleNamespace(reward_func_names=[COLUMN]), args=SimpleNamespace())


def test_neutral_weight_zero_matches_vanilla_grpo(tmp_path):
    common = dict(max_steps=1, reward_funcs=[accuracy_reward, digit_fraction_reward], output_dir=str(tmp_path),
                  log_level="error")
    vanilla = record_run(make_tiny_trainer(trainer_cls=trl.GRPOTrainer, **common))
    neutral = record_run(make_tiny_trainer(
        plugins=["posterior_grpo"], plugin_config={"posterior_grpo": {"prm": "programmatic", "process_weight": 0.0}},
        **common))
    for a, b in zip(vanilla.completion_ids, neutral.completion_ids):
        assert torch.equal(a, b)
    for a, b in zip(vanilla.rewards, neutral.rewards):
        assert b.shape[1] == a.shape[1] + 1 and torch.equal(a, b[:, :2])  # one more column, weight 0
    for a, b in zip(vanilla.advantages, neutral.advantages):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    torch.testing.assert_close(torch.tensor(vanilla.losses), torch.tensor(neutral.losses), atol=0, rtol=0)
    for key in vanilla.params:
        torch.testing.assert_close(vanilla.params[key], neutral.params[key], atol=0, rtol=0)


def test_end_to_end_with_scope_sharing_one_prm(tmp_path):
    """scope repairs one rollout per group (from scratch, reference solution); posterior_grpo pays the process
    reward of the now-correct rollout; both use the same PRM instance."""
    clear_shared_prms()
    trainer = make_tiny_trainer(
        plugins=["scope", "posterior_grpo"],
        plugin_config={"scope": {"mode": "reference_suffix", "prm": "programmatic", "min_prefix_steps": 0},
                       "posterior_grpo": {"prm": "programmatic"}},
        max_completion_length=40, loss_type="dr_grpo", max_steps=2, output_dir=str(tmp_path), log_level="error")
    scope, posterior = list(trainer.plugin_stack)
    assert scope.prm is posterior.prm and isinstance(scope.prm, ProgrammaticPRM)
    calls = []
    original = scope.prm.score_steps
    scope.prm.score_steps = lambda rows, comps: calls.append(len(comps)) or original(rows, comps)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    run_ = record_run(trainer)
    logs = [log for log in run_.logs if "loss" in log]
    assert len(logs) == 2
    for log in logs:
        assert log["plugins/scope/rectified_fraction"] == 0.25
        assert log[f"rewards/{COLUMN}/mean"] == pytest.approx(0.25)  # the repaired rollout's steps all verify
        assert log["plugins/posterior_grpo/paid_fraction"] == 0.25
    assert calls  # the shared PRM served both plugins (scope's failures, then posterior's successes)
    for rewards in run_.rewards:
        paid = rewards[:, 1] > 0
        assert torch.equal(paid, rewards[:, 0] > 0.5)  # paid exactly where the outcome is correct
    assert any(not torch.equal(before[n], p) for n, p in run_.params.items())
    clear_shared_prms()


# ------------------------------------------------------------------ trust mode, official SophiaVL-R1 defaults
# posterior_grpo trust mode with the official SophiaVL-R1 defaults: one-sided groups get no process reward, only
# answers with outcome >= 0.2 are scored (and sent to the PRM), the process column's weight is 0.3; the outcome column
# is chosen by the success rule (never a placeholder).


def _run_trust(outcome, texts, G, **options):
    N = len(outcome)
    matrix = torch.stack([torch.tensor(outcome, dtype=torch.float32), torch.zeros(N)], dim=1)
    ctx = make_reward_context(matrix, num_generations=G, reward_func_names=["accuracy", COLUMN],
                              completions=[[{"role": "assistant", "content": t}] for t in texts])
    stack = build_plugins(["posterior_grpo"], {"posterior_grpo": {"prm": "programmatic", "mode": "trust",
                                                                  "anneal": "none", **options}})
    plugin = next(iter(stack))
    plugin.prm = CountingPRM()
    stack.call("trl_plugins_transform_rewards", ctx)
    return ctx, plugin


def test_official_trust_mode_defaults():
    # group 0 all correct, group 1 all wrong, group 2 mixed with outcomes 1.0, 0.3 (scored), 0.1 (not scored)
    outcome = [1.0, 1.0, 0.0, 0.0, 1.0, 0.3, 0.1, 1.0]
    texts = ["a", "a", "a", "a", "a\nb", "a\nb", "a\nb", "a"]
    ctx, plugin = _run_trust(outcome, texts, 2)
    assert plugin.process_weight() == 0.3
    # groups 0 and 1 are one-sided: no PRM call, no process reward; row 6 (outcome 0.1 < 0.2) is not scored
    assert plugin.prm.seen == ["a\nb", "a\nb", "a"]
    values = ctx.rewards_per_func[:, 1].tolist()
    assert values[:4] == [0.0] * 4
    # group 2: correct 0.75 vs wrong 0.75 -> trust 1; group 3: correct 0.5 vs wrong (unscored) 0 -> trust 1
    assert values[4:] == [0.75, 0.75, 0.0, 0.5]
    assert ctx.metrics["plugins/posterior_grpo/process_reward_mean"] == [pytest.approx((0.75 + 0.75 + 0.5) / 3)]


def test_earlier_trust_mode_as_options():
    outcome = [1.0, 1.0, 0.0, 0.1]
    ctx, plugin = _run_trust(outcome, ["a", "a\nb", "a", "a\nb"], 2, trust_one_sided="full", trust_min_outcome=None,
                       process_weight=1.0)
    assert plugin.process_weight() == 1.0
    assert len(plugin.prm.seen) == 4
    assert ctx.rewards_per_func[:, 1].tolist() == [0.5, 0.75, 0.5, math.exp(0.0) * 0.75]


def test_posterior_mode_keeps_weight_one_and_outcome_skips_placeholders():
    stack = build_plugins(["posterior_grpo"], {"posterior_grpo": {"prm": "programmatic"}})
    assert next(iter(stack)).process_weight() == 1.0

    matrix = torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]])
    ctx = make_reward_context(matrix, num_generations=2, reward_func_names=["empo", "accuracy", COLUMN],
                              completions=[[{"role": "assistant", "content": t}] for t in ("a", "a\nb")],
                              run=RunInfo(placeholder_columns=(True, False, True)))
    plugin = next(iter(stack))
    plugin.prm = CountingPRM()
    stack.call("trl_plugins_transform_rewards", ctx)
    assert plugin.prm.seen == ["a\nb"]  # the outcome is 'accuracy' (row 1), not the placeholder 'empo' (row 0)
    assert ctx.rewards_per_func[:, 2].tolist() == [0.0, 0.75]

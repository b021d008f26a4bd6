"""ReMax: the advantage is the reward minus the reward of one greedy completion per prompt; the greedy completion is
generated through the generation service (greedy decoding, counted in the budget) and never trained on."""

import math

import pytest
import torch

from trl_plugins import PluginConfigError, PluginError, build_plugins
from trl_plugins.runtime.generation import greedy_decoding
from trl_plugins.testing import (
    StubGenerationService,
    assert_reduces_to_vanilla,
    digit_fraction_reward,
    make_advantage_context,
    make_rollout_context,
    make_tiny_trainer,
    record_run,
    run_hook,
)
from trl_plugins_builtin.remax import BASELINE_KEY, remax_advantages


# ------------------------------------------------------------------------------------------ formula
def test_advantage_is_reward_minus_the_groups_greedy_reward():
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.25, 0.75, float("nan")])
    adv = remax_advantages(rewards, torch.tensor([0.5, 0.25]), 3)
    torch.testing.assert_close(adv, torch.tensor([0.5, -0.5, 0.0, 0.0, 0.5, 0.0]))


def test_no_std_normalisation_scales_with_the_reward():
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.5])
    base = torch.tensor([0.25, 0.5])
    torch.testing.assert_close(remax_advantages(10 * rewards, 10 * base, 2), 10 * remax_advantages(rewards, base, 2))


# ------------------------------------------------------------------------------------------ sampling hook
def _rollout(groups, respond, **kwargs):
    service = StubGenerationService(respond)
    ctx = make_rollout_context(groups, service=service, reward_funcs=[digit_fraction_reward], **kwargs)
    run_hook("remax", "trl_plugins_after_generation", ctx)
    return ctx


def test_one_greedy_completion_per_group_scored_on_the_groups_first_row():
    ctx = _rollout([["12", "ab"], ["x", "9"]], lambda prompt, j: ["1a", "zz"][j])
    assert ctx.service.calls == [[ctx.prompts[0], ctx.prompts[2]]]  # the original prompts, one per group
    assert ctx.service.greedy_calls == [True]
    assert ctx.service.used_this_batch == 2  # counted in the rollout budget
    assert [a.get(BASELINE_KEY) for a in ctx.annotations] == [0.5, None, 0.0, None]
    assert not ctx.changed  # the greedy completion is never trained on
    assert ctx.metrics["plugins/remax/extra_rollouts"] == [2.0]
    assert ctx.metrics["plugins/remax/greedy_reward"] == [0.25]


def test_a_process_without_a_groups_first_row_still_calls_the_service():
    # process 1 of a G=4 batch split over two processes holds rows 2, 3 of group 0 only
    ctx = _rollout(["a", "b"], lambda prompt, j: "1", num_generations=4, process_index=1)
    assert ctx.service.calls == [[]]  # collective: called with nothing to ask
    assert all(BASELINE_KEY not in a for a in ctx.annotations)


def test_budget_is_enforced():
    service = StubGenerationService(lambda prompt, j: "1", budget=1)
    ctx = make_rollout_context([["1", "2"], ["3", "4"]], service=service, reward_funcs=[digit_fraction_reward])
    with pytest.raises(Exception, match="plugin_generation_budget"):
        run_hook("remax", "trl_plugins_after_generation", ctx)


# ------------------------------------------------------------------------------------------ advantage hook
def test_advantage_hook_replaces_trls_advantages():
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.5])
    annotations = [{BASELINE_KEY: 0.25}, {}, {BASELINE_KEY: 0.5}, {}]
    ctx = make_advantage_context(rewards, num_generations=2, annotations=annotations)
    run_hook("remax", "trl_plugins_transform_advantages", ctx)
    torch.testing.assert_close(ctx.advantages, torch.tensor([0.75, -0.25, 0.0, 0.0]))
    assert ctx.metrics["plugins/remax/baseline_mean"] == [0.375]


def test_missing_baseline_in_training_is_an_error_and_eval_keeps_trls():
    ctx = make_advantage_context(torch.tensor([1.0, 0.0]), num_generations=2)
    with pytest.raises(PluginError, match="no greedy baseline for group"):
        run_hook("remax", "trl_plugins_transform_advantages", ctx)
    ctx = make_advantage_context(torch.tensor([1.0, 0.0]), num_generations=2, mode="eval")
    before = ctx.advantages.clone()
    run_hook("remax", "trl_plugins_transform_advantages", ctx)
    torch.testing.assert_close(ctx.advantages, before)


def test_bad_option_is_refused():
    with pytest.raises(PluginConfigError, match="'greedy', 'trl'"):
        build_plugins(["remax"], {"remax": {"baseline": "mean"}})


# ------------------------------------------------------------------------------------------ real trainer
def test_greedy_decoding_is_argmax_and_restores_the_run_settings(tmp_path):
    trainer = make_tiny_trainer(output_dir=str(tmp_path), max_steps=1)
    config, kwargs = trainer.generation_config, dict(trainer.generation_kwargs)
    prompt = trainer.generation_service.tokenize([trainer.train_dataset[0]["prompt"]])
    with greedy_decoding(trainer):
        first, _ = trainer._generate_single_turn(prompt * 2, None, {}, num_generations=1)
        second, _ = trainer._generate_single_turn(prompt, None, {}, num_generations=1)
    assert first[0] == first[1] == second[0]
    # argmax step by step, independently of generate()
    ids = list(prompt[0])
    model = trainer.model.eval()
    expected = []
    with torch.no_grad():
        for _ in range(len(first[0])):
            nxt = int(model(torch.tensor([ids])).logits[0, -1].argmax())
            expected.append(nxt)
            ids.append(nxt)
            if nxt in trainer.eos_token_ids:
                break
    assert first[0] == expected
    assert trainer.generation_config is config and trainer.generation_kwargs == kwargs
    assert trainer.generation_config.do_sample


def test_end_to_end_advantages_are_reward_minus_greedy_reward(tmp_path):
    trainer = make_tiny_trainer(plugins=["remax"], reward_funcs=[digit_fraction_reward], per_device_train_batch_size=4,
                                num_generations=2, max_steps=2, output_dir=str(tmp_path))
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    run = record_run(trainer)
    logs = [log for log in run.logs if "loss" in log]
    for rewards, advantages, log in zip(run.rewards, run.advantages, logs):
        # advantages - rewards is minus the baseline: constant within each group, the logged greedy rewards' mean
        diff = (advantages - rewards.sum(1)).view(-1, 2)
        torch.testing.assert_close(diff[:, 0], diff[:, 1])
        assert log["plugins/remax/baseline_mean"] == pytest.approx(-float(diff[:, 0].mean()), abs=1e-6)
    assert trainer.generation_service.total == 2 * 2  # one greedy completion per prompt and step
    assert any(not torch.equal(before[n], p) for n, p in run.params.items())
    assert all("plugins/remax/greedy_reward" in log and "plugins/remax/baseline_mean" in log for log in logs)
    assert not math.isnan(logs[-1]["plugins/remax/greedy_reward"])


def test_trl_baseline_is_vanilla():
    assert_reduces_to_vanilla("remax", {"baseline": "trl"}, loss_types=("dapo",), steps=1)


def test_other_advantage_replacers_are_refused_with_the_reason():
    from trl_plugins import IncompatiblePluginsError

    with pytest.raises(IncompatiblePluginsError,
                       match="'remax' and 'riskpo' cannot be stacked: both replace the advantages outright"):
        build_plugins(["riskpo", "remax"])


def test_greedy_decoding_under_vllm_sets_temperature_zero_and_restores_it():
    from types import SimpleNamespace

    vllm = SimpleNamespace(temperature=0.7)
    trainer = SimpleNamespace(use_vllm=True, vllm_generation=vllm)
    with pytest.raises(RuntimeError):
        with greedy_decoding(trainer):
            assert vllm.temperature == 0.0  # vLLM's greedy decoding
            raise RuntimeError("generation failed")
    assert vllm.temperature == 0.7

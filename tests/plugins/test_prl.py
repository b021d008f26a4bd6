"""PRL: the suffix log-ratio and the step-end fill by hand; policy = reference gives the outcome term on every token;
consecutive per-token values differ by -d_t / eta; a large eta tends to TRL's advantages and eta = inf leaves them
alone; the advantage hook reads the reference through the context; the reference policy is the frozen initial
policy under full fine-tuning (beta = 0) and the adapter-off model under PEFT; neutral end-to-end run equals vanilla;
bad options refused."""

import math
from types import SimpleNamespace

import pytest
import torch

from trl_plugins import IncompatiblePluginsError, PluginConfigError, build_plugins
from trl_plugins.testing import (
    CharTokenizer,
    assert_runs_equal,
    build_stack,
    digit_fraction_reward,
    make_advantage_context,
    make_tiny_trainer,
    record_run,
    run_hook,
    stub_policy_stats,
)
from trl_plugins_builtin.prl import (
    fill_from_step_end,
    prl_token_advantages,
    step_end_mask,
    suffix_log_ratio,
)


def test_suffix_log_ratio_by_hand():
    lp = torch.tensor([[-1.0, -2.0, -0.5, -3.0]])
    ref = torch.tensor([[-1.5, -1.0, -0.5, -1.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    # d = [0.5, -1.0, 0.0, (masked)] -> S = [-0.5, -1.0, 0.0, 0]
    torch.testing.assert_close(suffix_log_ratio(lp, ref, mask), torch.tensor([[-0.5, -1.0, 0.0, 0.0]]))


def test_step_ends_by_length_and_separator():
    mask = torch.tensor([[1.0, 1, 1, 1, 1, 0], [1.0, 1, 0, 0, 0, 0]])
    ends = step_end_mask(mask, torch.zeros(2, 6, dtype=torch.long), "length", 2)
    assert ends.tolist() == [[False, True, False, True, True, False], [False, True, False, False, False, False]]
    ids = torch.tensor([[5, 9, 5, 5, 9, 9], [9, 5, 5, 5, 5, 5]])
    ends = step_end_mask(mask, ids, "newline", 99, separator_id=9)
    assert ends.tolist() == [[False, True, False, False, True, False], [True, True, False, False, False, False]]


def test_fill_from_step_end():
    values = torch.tensor([[1.0, 2.0, 3.0, 4.0, 5.0]])
    ends = torch.tensor([[False, True, False, False, True]])
    torch.testing.assert_close(fill_from_step_end(values, ends), torch.tensor([[2.0, 2.0, 5.0, 5.0, 5.0]]))


def test_policy_equal_to_reference_gives_the_outcome_on_every_token():
    lp = -torch.rand(3, 5)
    mask = torch.ones(3, 5)
    mask[1, 3:] = 0
    outcome = torch.tensor([0.7, -1.2, 0.0])
    adv = prl_token_advantages(outcome, lp, lp, mask, 200.0, step_end_mask(mask, None, "length", 2))
    torch.testing.assert_close(adv, outcome.unsqueeze(1) * mask)


def test_per_token_values_differ_by_the_log_ratio_over_eta():
    g = torch.Generator().manual_seed(1)
    lp, ref = -torch.rand(2, 6, generator=g), -torch.rand(2, 6, generator=g)
    mask = torch.ones(2, 6)
    adv = prl_token_advantages(torch.tensor([1.0, 0.0]), lp, ref, mask, 4.0, None)
    torch.testing.assert_close(adv[:, :-1] - adv[:, 1:], -(lp - ref)[:, :-1] / 4.0)
    # a policy more likely than the reference at the end is penalised: last token value = R - d_T / eta
    torch.testing.assert_close(adv[:, -1], torch.tensor([1.0, 0.0]) - (lp - ref)[:, -1] / 4.0)


def _ctx(ref_shift=0.3, **kwargs):
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.0])
    stats = stub_policy_stats(4, 6, seed=2)
    ref = stats.per_token_logps - ref_shift
    calls = []

    def reference():
        calls.append(1)
        return ref

    ctx = make_advantage_context(rewards, num_generations=2, policy_stats=stats, reference_logprobs=reference,
                                 **kwargs)
    ctx.reference_calls = calls
    return ctx, stats, ref


def test_hook_gives_token_advantages_from_the_reference():
    ctx, stats, ref = _ctx()
    trl_adv = ctx.advantages.clone()
    run_hook("prl", "trl_plugins_transform_advantages", ctx, {"prl": {"eta": 2.0, "step_len": 3}})
    assert ctx.reference_calls == [1]
    assert ctx.advantages.shape == (4, 6)
    ends = step_end_mask(stats.mask, stats.completion_ids, "length", 3)
    expected = prl_token_advantages(trl_adv, stats.per_token_logps, ref, stats.mask, 2.0, ends)
    torch.testing.assert_close(ctx.advantages, expected)
    # policy above the reference everywhere: every token's advantage is below the outcome advantage
    assert torch.all(ctx.advantages < trl_adv.unsqueeze(1))
    assert "plugins/prl/process_term" in ctx.metrics


def test_raw_mode_uses_rewards_per_token():
    ctx, stats, ref = _ctx()
    run_hook("prl", "trl_plugins_transform_advantages", ctx, {"prl": {"eta": 2.0, "advantage": "raw"}})
    expected = prl_token_advantages(torch.tensor([1.0, 0.0, 0.5, 0.0]), stats.per_token_logps, ref, stats.mask,
                                    2.0, None)
    torch.testing.assert_close(ctx.advantages, expected)


def test_large_eta_tends_to_trl_and_infinite_eta_is_neutral():
    ctx, _, _ = _ctx()
    trl_adv = ctx.advantages.clone()
    run_hook("prl", "trl_plugins_transform_advantages", ctx, {"prl": {"eta": 1e9}})
    torch.testing.assert_close(ctx.advantages, trl_adv.unsqueeze(1).expand(4, 6))
    ctx, _, _ = _ctx()
    run_hook("prl", "trl_plugins_transform_advantages", ctx, {"prl": {"eta": math.inf}})
    assert torch.equal(ctx.advantages, trl_adv) and ctx.reference_calls == []


def test_newline_separator_comes_from_the_tokenizer():
    stack = build_plugins(["prl"], {"prl": {"step_split": "double_newline"}})
    stack.call("trl_plugins_configure", trainer=SimpleNamespace(processing_class=CharTokenizer()), args=None)
    assert stack.plugins[0]._separator == CharTokenizer().encode("\n\n")[0]


def test_bad_options_are_refused():
    with pytest.raises(PluginConfigError, match="eta"):
        build_plugins(["prl"], {"prl": {"eta": 0.0}})
    with pytest.raises(PluginConfigError, match="step_split"):
        build_plugins(["prl"], {"prl": {"step_split": "sentence"}})
    with pytest.raises(IncompatiblePluginsError, match="advantage estimator"):
        build_plugins(["prl", "canon"])
    assert build_stack("prl")  # configure with the stub trainer and the default (length) split


# ------------------------------------------------------------------------------------------ end to end (tiny model)
def _trainer(tmp_path, name, **config):
    return make_tiny_trainer(reward_funcs=[digit_fraction_reward], max_steps=2, output_dir=str(tmp_path / name),
                             **config)


def test_neutral_eta_end_to_end_is_vanilla(tmp_path):
    from trl import GRPOTrainer

    run = record_run(_trainer(tmp_path, "a", plugins=["prl"], plugin_config={"prl": {"eta": math.inf}}))
    vanilla = record_run(_trainer(tmp_path, "b", trainer_cls=GRPOTrainer))
    assert_runs_equal(run, vanilla)


def test_full_fine_tuning_keeps_a_frozen_initial_policy(tmp_path):
    trainer = _trainer(tmp_path, "c", plugins=["prl"], plugin_config={"prl": {"eta": 0.5, "step_len": 4}},
                       learning_rate=1e-2)
    initial = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    assert trainer.reference_copy is not None and trainer.ref_model is None
    run = record_run(trainer)
    ref_params = dict(trainer.reference_copy.named_parameters())
    assert all(torch.equal(initial[n], ref_params[n]) for n in initial)  # the reference never trains
    assert any(not torch.equal(initial[n], p) for n, p in run.params.items())  # the policy does
    assert all(not p.requires_grad for p in ref_params.values())
    assert any(a.dim() == 2 for a in run.advantages)
    logs = [log for log in run.logs if "loss" in log]
    assert logs and all("plugins/prl/process_term" in log for log in logs)
    # after training, the policy's log-ratio to the frozen reference is no longer zero
    assert any(log["plugins/prl/sequence_log_ratio"] != 0 for log in logs[1:])


def _batch(trainer):
    g = torch.Generator().manual_seed(0)
    vocab = trainer.model.config.vocab_size
    prompt = torch.randint(3, vocab, (2, 5), generator=g)
    completion = torch.randint(3, vocab, (2, 7), generator=g)
    return {"prompt_ids": prompt, "prompt_mask": torch.ones_like(prompt), "completion_ids": completion,
            "completion_mask": torch.ones_like(completion)}


def _policy_logps(trainer, batch):
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    with torch.no_grad():
        return trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, 7)[0]


def test_peft_reference_is_the_initial_model_with_the_adapter_off(tmp_path):
    from peft import LoraConfig

    from trl_plugins.runtime.reference import reference_logprobs

    lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    trainer = _trainer(tmp_path, "d", plugins=["prl"], plugin_config={"prl": {"eta": 0.5}}, peft_config=lora,
                       learning_rate=5e-2)
    assert trainer.reference_copy is None  # no copy: the adapter is switched off instead
    batch = _batch(trainer)
    initial = _policy_logps(trainer, batch)  # LoRA B = 0: the policy is the base model
    run = record_run(trainer)
    assert any(a.dim() == 2 for a in run.advantages)
    trained = _policy_logps(trainer, batch)
    assert not torch.allclose(trained, initial)  # the adapter trained
    torch.testing.assert_close(reference_logprobs(trainer, batch, {}), initial)

"""HAPO's adaptive sampling temperature: the official entropy statistics and T (1 + tau h_hat) by hand (both signs of
the negative side); the statistics of a step come from its loss tokens; the per-token processor divides by the rule's
temperatures before top-k; on the tiny model the trainer's transformers generation hands the rule the raw logits
(TRL's temperature warper neutralised) and samples from logits / T_t (a near-zero T_t reproduces greedy decoding);
vLLM is refused."""

import math
from types import SimpleNamespace

import pytest
import torch

from trl_plugins import IncompatiblePluginsError, PluginConfigError, PluginGRPOTrainer
from trl_plugins.runtime.generation import greedy_decoding
from trl_plugins.testing import build_stack, make_loss_context, make_tiny_trainer
from trl_plugins.runtime.token_temperature import TokenTemperatureProcessor
from trl_plugins_builtin.hapo import EntropyStats, adaptive_temperatures, entropy_statistics

NEUTRAL_LOSS = {"token_level_advantage": False, "clip_alpha": 0.0, "adv_beta": 0.0, "dual_clip_c": None}


def test_entropy_statistics_by_hand():
    H = torch.tensor([math.e ** -2, math.e ** -1, 1.0, math.e, math.e ** 2])  # log-entropies -2, -1, 0, 1, 2
    stats = entropy_statistics(H, pivot=0.5)  # nearest-rank median: 0
    std = math.sqrt((4 + 1 + 0 + 1 + 4) / 5)
    assert stats.median == pytest.approx(0.0, abs=1e-6)
    assert stats.std == pytest.approx(std)
    assert stats.scale_pos == pytest.approx(std / 2) and stats.scale_neg == pytest.approx(std / 2)
    assert entropy_statistics(H, pivot=0.5, code_sign=True).scale_neg == pytest.approx(-std / 2)  # official sign


def test_temperature_rule_by_hand():
    stats = EntropyStats(median=0.0, std=1.0, scale_pos=0.5, scale_neg=0.25)
    V = 8
    logits = torch.stack([torch.zeros(V), torch.tensor([50.0] + [0.0] * (V - 1))])  # uniform: H = ln 8; ~one-hot
    T = adaptive_temperatures(logits, stats, temperature=0.7, tau=0.05)
    h_uniform = math.log(math.log(V)) / (1.0 + 1e-6)  # > 0: scale_pos
    h_peaked = math.log(1e-6) / (1.0 + 1e-6)  # entropy below eps: clamped, then h_hat clipped to -1
    expected = [0.7 * (1 + 0.05 * min(1.0, h_uniform * 0.5)), 0.7 * (1 + 0.05 * max(-1.0, h_peaked * 0.25))]
    torch.testing.assert_close(T, torch.tensor(expected))
    official = adaptive_temperatures(logits, stats._replace(scale_neg=-0.25), 0.7, 0.05)
    assert official[1] > 0.7  # the official sampler's negative scale raises low-entropy tokens' temperature too


def test_step_statistics_come_from_the_loss_tokens():
    stack = build_stack("hapo", {"hapo": {**NEUTRAL_LOSS, "temperature_tau": 0.05}}, trainer=SimpleNamespace(
        set_token_temperature=lambda rule: None))
    plugin = stack.plugins[0]
    entropies = torch.tensor([[0.5, 1.0, 2.0, 9.0], [0.1, 3.0, 7.0, 8.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    ctx = make_loss_context(entropies=entropies, mask=mask)
    ctx.set_active_plugin("hapo")
    plugin.trl_plugins_loss(ctx)
    assert plugin.entropy_stats is None
    logits = torch.randn(3, 5)
    assert plugin.sampling_temperatures(logits).tolist() == [1.0] * 3  # no statistics yet: the run's temperature
    plugin.trl_plugins_on_step_end(trainer=None, step=1)
    assert plugin.entropy_stats == entropy_statistics(torch.tensor([0.5, 1.0, 2.0, 0.1, 3.0]), 0.8)
    torch.testing.assert_close(plugin.sampling_temperatures(logits),
                               adaptive_temperatures(logits, plugin.entropy_stats, 1.0, 0.05))


def test_processor_divides_by_the_rules_temperatures_then_top_k():
    scores = torch.tensor([[1.0, 2.0, 3.0], [3.0, 1.0, 2.0]])
    processor = TokenTemperatureProcessor(lambda logits: torch.tensor([0.5, 2.0]))
    torch.testing.assert_close(processor(None, scores), scores / torch.tensor([[0.5], [2.0]]))
    top2 = TokenTemperatureProcessor(lambda logits: torch.tensor([0.5, 2.0]), top_k=2)(None, scores)
    assert torch.isinf(top2[0, 0]) and torch.isinf(top2[1, 1])
    torch.testing.assert_close(top2[0, 1:], torch.tensor([4.0, 6.0]))


def test_tiny_model_samples_from_raw_logits_over_the_rules_temperature():
    trainer = make_tiny_trainer(plugins=["hapo"], plugin_config={"hapo": {**NEUTRAL_LOSS, "temperature_tau": 0.05}},
                                temperature=0.5, max_completion_length=6)
    plugin = trainer.plugin_stack.plugins[0]
    assert trainer._token_temperature == plugin.sampling_temperatures
    prompt_ids = trainer.generation_service.tokenize(["1+1=", "2+3="])
    with greedy_decoding(trainer):
        greedy, _ = trainer._generate_single_turn(prompt_ids, None, {}, 1)
    seen = []

    def near_zero(logits):  # T_t -> 0: sampling from logits / T_t is greedy decoding
        seen.append(logits.clone())
        return torch.full(logits.shape[:1], 1e-4)

    trainer.set_token_temperature(near_zero)
    sampled, _ = trainer._generate_single_turn(prompt_ids, None, {}, 1)
    assert sampled == greedy
    model = trainer.accelerator.unwrap_model(trainer.model_wrapped)
    with torch.no_grad():
        raw = model(torch.tensor([prompt_ids[0]])).logits[0, -1]
    torch.testing.assert_close(seen[0][0], raw.float())  # raw logits: TRL's temperature 0.5 was not applied first
    assert trainer.generation_config.temperature == 0.5 and "generate" not in vars(model)  # restored after
    calls = len(seen)
    trainer.set_token_temperature(None)  # TRL's own sampling again: the rule is no longer consulted
    trainer._generate_single_turn(prompt_ids, None, {}, 1)
    assert len(seen) == calls


def test_a_trainer_without_a_rule_samples_with_trls_temperature():
    trainer = make_tiny_trainer(plugins=[], max_completion_length=3)
    assert trainer._token_temperature is None  # initialised by the constructor, off
    out, _ = trainer._generate_single_turn(trainer.generation_service.tokenize(["1+1="]), None, {}, 1)
    assert len(out) == 1 and 0 < len(out[0]) <= 3


def test_sampled_tokens_follow_softmax_of_the_logits_over_hapos_temperature():
    # tau = 1 and statistics that clip every h_hat to +1: T_t = 0.5 (1 + 1) = 1.0 while TRL's temperature is 0.5
    trainer = make_tiny_trainer(plugins=["hapo"], plugin_config={"hapo": {**NEUTRAL_LOSS, "temperature_tau": 1.0}},
                                temperature=0.5)
    trainer.plugin_stack.plugins[0].entropy_stats = EntropyStats(median=-100.0, std=1.0, scale_pos=1.0, scale_neg=1.0)
    trainer.set_generation_length_cap(1)
    ids = trainer.generation_service.tokenize(["1+1="])[0]
    torch.manual_seed(0)
    out, _ = trainer._generate_single_turn([ids] * 3000, None, {}, 1)
    model = trainer.accelerator.unwrap_model(trainer.model_wrapped)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, -1].float()
    tokens = torch.tensor([c[0] for c in out])
    rule, trl = torch.log_softmax(logits / 1.0, -1), torch.log_softmax(logits / 0.5, -1)
    assert (torch.bincount(tokens, minlength=logits.numel()) > 0).all()  # no top-k (TRL's top_k=0) crept in
    # mean log-likelihood ratio of the samples: KL(p_rule || p_trl) > 0 if they come from p_rule, -KL(p_trl || p_rule)
    # < 0 if they came from TRL's single temperature
    llr = float((rule[tokens] - trl[tokens]).mean())
    kl_rule = float((rule.exp() * (rule - trl)).sum())
    assert abs(llr - kl_rule) < 0.4 * kl_rule, (llr, kl_rule)


def test_vllm_is_refused():
    with pytest.raises(IncompatiblePluginsError, match="cannot go through vLLM"):
        build_stack("hapo", {"hapo": {"temperature_tau": 0.05}}, use_vllm=True)
    with pytest.raises(PluginConfigError, match="vLLM"):
        PluginGRPOTrainer.set_token_temperature(SimpleNamespace(use_vllm=True), lambda logits: logits[:, 0])

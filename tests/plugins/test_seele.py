"""seele (SEELE, arXiv:2509.06923): the three-parameter logistic fit and its inverse,
solution-step hints and the pessimistic cold start, the first round hinted with deferred later rounds, the second
round sampled from each problem's fitted rate (one collective call, trained under the hinted prompt), the remembered
rates, option checks and a tiny-model run; with the hint at the start of the response (the paper's placement): the hint
tokens leading the completion (off-policy, under the original prompt, the later round continuing them), their count
riding to the loss, and the imitation term -gamma log pi replacing the surrogate on them."""

import math

import pytest
import torch

from trl_plugins import PluginConfigError, build_plugins
from trl_plugins.api.services import RunInfo
from trl_plugins.testing import (
    StubGenerationService,
    assert_reduces_to_vanilla,
    build_stack,
    char_encode,
    loss_from_context,
    make_advantage_context,
    make_loss_context,
    make_prompt_context,
    make_rollout_context,
    make_tiny_trainer,
    record_run,
    stub_rows,
)
from trl_plugins_builtin.seele import (
    HINT_TOKENS_KEY,
    cold_start_rate,
    fit_three_pl,
    hint_token_mask,
    imitation_term,
    rate_for_accuracy,
    seele_hint,
    three_pl,
)


def _text(prompt):
    return prompt if isinstance(prompt, str) else prompt[-1]["content"]


def _hint_of(prompt_text):
    marker = "refer to:\n"
    return prompt_text.split(marker, 1)[1] if marker in prompt_text else ""


def _score(rows, prompts, completions):
    return torch.tensor([1.0 if _text(c).startswith("OK") else 0.0 for c in completions])


STEPS = "s1\ns2\ns3\ns4"  # four solution steps
SEELE = {"rounds": 2, "hint_in": "prompt"}
SEELE_RESPONSE = {"rounds": 2}  # the paper's placement: the hint starts the response


def test_three_pl_fit_recovers_the_curve_and_inverts_it():
    rates = [0.2, 0.4, 0.6, 0.8, 1.0]
    accuracies = three_pl(torch.tensor(rates), 20.0, -0.6, 0.05).tolist()
    k, mu, b = fit_three_pl(rates, accuracies)
    assert (k, mu, b) == pytest.approx((20.0, -0.6, 0.05), abs=1e-3)
    # f(p) = 0.5 at p = -mu - ln((1-b)/(0.5-b) - 1)/k
    expected = 0.6 - math.log(0.95 / 0.45 - 1) / 20.0
    assert rate_for_accuracy(0.5, k, mu, b) == pytest.approx(expected, abs=1e-4)
    assert rate_for_accuracy(0.5, 5.0, 0.0, 0.6) == 0.0  # the floor already reaches the target
    # repeated rates are averaged before the fit (the paper's Eq. 13)
    assert fit_three_pl([0.5, 0.5, 1.0], [0.0, 1.0, 1.0]) == pytest.approx(fit_three_pl([0.5, 1.0], [0.5, 1.0]))


def test_seele_hints_are_solution_step_prefixes():
    assert cold_start_rate(STEPS, "lines") == 0.75
    assert seele_hint(STEPS, 0.75, "lines") == "s1\ns2\ns3"
    assert seele_hint(STEPS, 0.1, "lines") == ""
    assert seele_hint("ABCDEFGH", 0.5, "chars") == "ABCD"


def _seele_rows():
    return stub_rows(2, 4, solution=STEPS)


def test_seele_first_round_is_hinted_and_later_rounds_deferred():
    stack = build_stack("seele", {"seele": SEELE})
    stack.plugins[0].rates[_text(_seele_rows()[4]["prompt"])] = 0.25  # remembered rate of group 1
    ctx = make_prompt_context(_seele_rows(), num_generations=4)
    stack.call("trl_plugins_generation_prompts", ctx)
    assert ctx.deferred == [False, False, True, True] * 2
    for i in (0, 1):
        assert _hint_of(_text(ctx.generation_prompts[i])) == "s1\ns2\ns3"  # cold start (S - 1) / S
        assert ctx.training_prompts[i] == ctx.generation_prompts[i] and ctx.annotations[i]["hint_rate"] == 0.75
    assert _hint_of(_text(ctx.generation_prompts[4])) == "s1"
    assert ctx.generation_prompts[2] == ctx.prompts[2]  # deferred rows are filled after generation


def test_seele_second_round_uses_the_fitted_rate_and_trains_under_it():
    rows = _seele_rows()
    # round 1 (slots 0, 1): group 0 all correct with 3 steps revealed, group 1 all wrong
    service = StubGenerationService(lambda prompt, j: "OK" if _hint_of(_text(prompt)).count("s") >= 2 else "no")
    ctx = make_rollout_context([["OK", "OK", "", ""], ["no", "no", "", ""]], rows=rows, deferred=[2, 3, 6, 7],
                               scorer=_score, service=service,
                               annotations=[{"hint_rate": 0.75} for _ in range(8)], run=RunInfo(max_completion_length=16))
    stack = build_stack("seele", {"seele": SEELE})
    stack.call("trl_plugins_after_generation", ctx)
    assert len(service.calls) == 1 and len(service.calls[0]) == 4  # one collective call: the deferred rows
    k, mu, b = fit_three_pl([0.75], [1.0])
    rate0 = rate_for_accuracy(0.5, k, mu, b)
    rate1 = rate_for_accuracy(0.5, *fit_three_pl([0.75], [0.0]))
    assert rate0 < 0.75 < rate1  # easier than the target: shorter hint; harder: longer hint
    for i in (2, 3):
        assert ctx.annotations[i]["hint_rate"] == pytest.approx(rate0) and ctx.annotations[i]["seele_round"] == 1
        assert ctx.training_prompts[i] != ctx.prompts[i] or seele_hint(STEPS, rate0, "lines") == ""
    assert _hint_of(_text(ctx.training_prompts[6])) == seele_hint(STEPS, rate1, "lines")
    assert all(i in ctx.changed for i in (2, 3, 6, 7)) and not any(ctx.prompt_swapped)
    stored = stack.plugins[0].rates
    assert set(stored) == {_text(rows[0]["prompt"]), _text(rows[4]["prompt"])}
    assert ctx.metrics["plugins/seele/round_1_accuracy"] == [0.5]
    assert stack.plugins[0].trl_plugins_state_dict()["rates"] == stored


def test_seele_option_checks():
    with pytest.raises(PluginConfigError, match="'rounds' of plugin 'seele' got 3; num_generations=4 must be a multiple"):
        build_stack("seele", {"seele": {"rounds": 3}}, num_generations=4)
    with pytest.raises(PluginConfigError, match="'rounds' of plugin 'seele' got 1"):
        build_plugins(["seele"], {"seele": {"rounds": 1}})
    with pytest.raises(PluginConfigError, match="'template' of plugin 'seele'"):
        build_plugins(["seele"], {"seele": {"template": "{question} only"}})
    with pytest.raises(PluginConfigError, match="'target_accuracy' of plugin 'seele' got 0"):
        build_plugins(["seele"], {"seele": {"target_accuracy": 0.0}})


def test_warmup_steps_are_plain_grpo():
    """Every problem is hinted once SEELE runs, so its only neutral setting is the warm-up: plain GRPO before it."""
    runs = assert_reduces_to_vanilla("seele", {"warmup_steps": 5}, loss_types=("dapo",), steps=1)
    assert not any("plugins/seele/mean_hint_rate" in log for log in runs["dapo"].logs)


def test_seele_tiny_run_trains_every_group_with_fitted_hints():
    trainer = make_tiny_trainer(plugins=["seele"], plugin_config={"seele": SEELE_RESPONSE},
                                max_steps=1, max_completion_length=16)
    run = record_run(trainer)
    logs = {k: v for log in run.logs for k, v in log.items()}
    assert 0.0 <= logs["plugins/seele/mean_hint_rate"] <= 1.0
    assert "plugins/seele/round_1_accuracy" in logs
    assert logs["plugins/seele/hint_token_fraction"] > 0  # hint tokens reached the loss
    assert trainer.plugin_stack.plugins[0].rates  # remembered for the next visit


# ------------------------------------------------------------------------------------------ hint in the response
def test_hint_token_mask_and_imitation_term_by_hand():
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    hint = hint_token_mask(torch.tensor([2.0, 3.0, 0.0]), mask)
    assert hint.tolist() == [[1, 1, 0, 0], [1, 1, 0, 0], [0, 0, 0, 0]]  # padding never counts
    lp = torch.log(torch.tensor([[0.5, 0.25, 0.9, 0.9]] * 3))
    assert torch.allclose(imitation_term(lp, hint, 0.001)[0], 0.001 * torch.tensor([math.log(2), math.log(4), 0, 0]))


def test_loss_trains_hint_tokens_by_imitation_and_the_rest_by_the_surrogate():
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 0.0]])
    g = torch.Generator().manual_seed(0)
    lp = (-2 * torch.rand(2, 4, generator=g)).requires_grad_(True)
    counts = torch.tensor([2.0, 1.0])
    ctx = make_loss_context(lp, mask=mask, advantages=torch.tensor([1.0, -1.0]), loss_type="dapo",
                            extras={HINT_TOKENS_KEY: counts})
    base = ctx.per_token_loss.detach().clone()
    stack = build_stack("seele", {"seele": SEELE_RESPONSE}, loss_type="dapo")
    stack.call("trl_plugins_loss", ctx)
    loss = loss_from_context(ctx)
    hint = torch.tensor([[1.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]])
    expected = ((ctx.per_token_loss * (1 - hint) - 0.001 * lp * hint) * mask).sum() / mask.sum()
    assert torch.allclose(loss, expected)
    (grad,) = torch.autograd.grad(loss, lp)
    assert torch.allclose(grad[0, :2], torch.full((2,), -0.001 / 7))  # d(-gamma log pi) / d log pi, dapo over 7
    assert torch.allclose(grad[0, 2:], torch.full((2,), -1.0 / 7))  # ratio surrogate, A = +1, first pass
    assert ctx.metrics["plugins/seele/hint_token_fraction"] == [pytest.approx(3 / 7)]
    # hint_surrogate keeps the surrogate on the hint tokens too; coefficient 0 drops the term
    ctx2 = make_loss_context(lp, mask=mask, advantages=torch.tensor([1.0, -1.0]), loss_type="dapo",
                             extras={HINT_TOKENS_KEY: counts})
    build_stack("seele", {"seele": {**SEELE_RESPONSE, "hint_surrogate": True, "imitation_coef": 0.0}}, loss_type="dapo").call(
        "trl_plugins_loss", ctx2)
    assert torch.allclose(loss_from_context(ctx2), (base * mask).sum() / mask.sum())


def test_hint_token_counts_ride_from_annotations_to_the_loss():
    ctx = make_advantage_context(torch.tensor([1.0, 0.0, 1.0, 0.0]), num_generations=4,
                                 annotations=[{HINT_TOKENS_KEY: 3}, {}, {HINT_TOKENS_KEY: 1}, {}])
    build_stack("seele", {"seele": SEELE_RESPONSE}).call("trl_plugins_transform_advantages", ctx)
    assert ctx.extras[HINT_TOKENS_KEY].tolist() == [3.0, 0.0, 1.0, 0.0]
    ctx = make_advantage_context(torch.tensor([1.0, 0.0, 1.0, 0.0]), num_generations=4,
                                 annotations=[{HINT_TOKENS_KEY: 3}, {}, {}, {}])
    build_stack("seele", {"seele": SEELE}).call("trl_plugins_transform_advantages", ctx)
    assert HINT_TOKENS_KEY not in ctx.extras  # hint in the prompt: nothing to imitate


def _ok_anywhere(rows, prompts, completions):
    return torch.tensor([1.0 if "OK" in _text(c) else 0.0 for c in completions])


def test_response_placement_puts_the_hint_first_and_continues_it():
    rows = _seele_rows()
    service = StubGenerationService(lambda prompt, j: "OK")
    sampled = [["gen a", "gen b", "", ""], ["no", "no", "", ""]]  # round 1 of TRL, under the hinted prompt
    ctx = make_rollout_context(sampled, rows=rows, deferred=[2, 3, 6, 7], scorer=_ok_anywhere, service=service,
                               annotations=[{"hint_rate": 0.75} for _ in range(8)],
                               run=RunInfo(max_completion_length=32))
    stack = build_stack("seele", {"seele": SEELE_RESPONSE})
    stack.call("trl_plugins_after_generation", ctx)
    first_hint = char_encode("s1\ns2\ns3\n")  # cold start 3 of 4 steps, and a line break
    for i, text in ((0, "gen a"), (4, "no")):
        n = len(first_hint)
        assert ctx.completion_ids[i] == first_hint + char_encode(text)
        assert ctx.offpolicy[i] == [True] * n + [False] * len(text) and ctx.annotations[i][HINT_TOKENS_KEY] == n
        assert ctx.training_prompts[i] == ctx.prompts[i] and ctx.prompt_swapped[i]
        assert all(math.isnan(x) for x in ctx.sampling_logprobs[i])
    # round 2: the original prompts, continued after each problem's fitted hint (one collective call)
    assert len(service.calls) == 1 and service.calls[0] == [ctx.prompts[i] for i in (2, 3, 6, 7)]
    rate1 = rate_for_accuracy(0.5, *fit_three_pl([0.75], [0.0]))
    hint1 = seele_hint(STEPS, rate1, "lines")
    for i in (6, 7):
        n = len(char_encode(hint1 + "\n")) if hint1 else 0
        assert ctx.completion_ids[i][:n] == char_encode(hint1 + "\n")[:n] and ctx.completion_ids[i][n:] == char_encode("OK")
        assert ctx.offpolicy[i] == [True] * n + [False] * 2 and ctx.annotations[i].get(HINT_TOKENS_KEY, 0) == n
        assert not ctx.prompt_swapped[i] and ctx.training_prompts[i] == ctx.prompts[i]
        assert all(math.isnan(x) for x in ctx.sampling_logprobs[i][:n]) and ctx.sampling_logprobs[i][n:] == [-1.0] * 2
        assert ctx.annotations[i]["seele_round"] == 1

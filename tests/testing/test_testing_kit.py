"""The testing kit for plugin authors (``trl_plugins.testing``): hand-made contexts and their stub services,
stage-contract assertions, enabling/calling helpers, simulated processes, and the reduction-to-vanilla check.

The hand-made contexts are checked against what the real trainer builds: the kit's loss composition against the
trainer's loss, and the contract assertions on real contexts and a real generation batch."""

import math
import threading
from dataclasses import dataclass

import pytest
import torch

from trl_plugins import (
    GenerationBudgetExceeded,
    Plugin,
    PluginConfigError,
    PluginError,
    PluginOptions,
    RewardContext,
    RunInfo,
    available_plugins,
    hookimpl,
    option,
)
from trl_plugins.runtime import loss_rules as rules
from trl_plugins.api.contexts import OFFPOLICY_KEY
from trl_plugins.testing import (
    StubGenerationService,
    assert_group_sizes,
    assert_offpolicy_logprobs_nan,
    assert_reduces_to_vanilla,
    build_stack,
    char_encode,
    digit_fraction_reward,
    group_normalized_advantages,
    loss_from_context,
    make_advantage_context,
    make_loss_context,
    make_prompt_context,
    make_reward_context,
    make_rollout_context,
    make_tiny_trainer,
    prompt_text,
    run_hook,
    run_on_processes,
    stub_rows,
    temporary_plugin,
    tiny_tokenizer,
)


# ============================================================================================ hand-made contexts


def test_stub_rows_repeat_each_prompt_g_times_with_columns():
    rows = stub_rows(2, 3, solution=["s0", "s1"], answer=lambda g: str(10 + g), level=1, first_group=4)
    assert len(rows) == 6
    assert [prompt_text(r["prompt"]) for r in rows] == ["Q4"] * 3 + ["Q5"] * 3
    assert [r["solution"] for r in rows] == ["s0"] * 3 + ["s1"] * 3
    assert [r["answer"] for r in rows] == ["10"] * 3 + ["11"] * 3
    assert all(r["level"] == 1 for r in rows)
    rows[0]["prompt"][0]["content"] = "changed"  # rows are independent copies
    assert prompt_text(rows[1]["prompt"]) == "Q4"
    assert stub_rows(1, 2, conversational=False)[0]["prompt"] == "Q0"


def test_prompt_context_matches_the_trainer_layout():
    ctx = make_prompt_context(num_groups=2, num_generations=3, process_index=1, step=7)
    assert ctx.global_index == [6, 7, 8, 9, 10, 11]
    assert ctx.group_ids == [2, 2, 2, 3, 3, 3] and ctx.index_in_group == [0, 1, 2, 0, 1, 2]
    assert ctx.generation_prompts == ctx.training_prompts == ctx.prompts and ctx.step == 7
    assert_group_sizes(ctx)
    ctx.log_metric("x", 1)  # outside a hook: no active plugin
    assert ctx.metrics == {"plugins/framework/x": [1.0]}


def test_assert_group_sizes_catches_broken_sampling_contexts():
    ctx = make_prompt_context(num_groups=2, num_generations=2)
    ctx.generation_prompts.pop()
    with pytest.raises(AssertionError, match="generation_prompts has 3 entries for 4 rows"):
        assert_group_sizes(ctx)
    ctx = make_prompt_context(num_groups=2, num_generations=2)
    ctx.index_in_group[1] = 0
    with pytest.raises(AssertionError, match="global index 1 has group id 0 and index in group 0"):
        assert_group_sizes(ctx)
    ctx = make_rollout_context([["a", "b"], ["c", "d"]])
    ctx.completion_ids.append([1])
    with pytest.raises(AssertionError, match="completion_ids has 5 entries for 4 rows"):
        assert_group_sizes(ctx)
    ctx = make_rollout_context([["a", "b"], ["c", "d"]])
    ctx.prompts[1] = [{"role": "user", "content": "other"}]
    with pytest.raises(AssertionError, match="rows of group 0 have different prompts"):
        assert_group_sizes(ctx)


def test_rollout_context_stub_services():
    ctx = make_rollout_context([["12", "ab"], ["x", "3y"]])
    assert len(ctx) == 4 and ctx.num_generations == 2
    assert ctx.completion_ids[0] == char_encode("12") and ctx.completions[1] == [{"role": "assistant", "content": "ab"}]
    assert ctx.prompt_ids[2] == char_encode("Q1") and ctx.tokenize_prompts(["hi"]) == [char_encode("hi")]
    assert ctx.sampling_logprobs[3] == [-1.0, -1.0]
    # ctx.score runs the reward functions (default: digit fraction), weighted
    assert ctx.score(range(4)).tolist() == [1.0, 0.0, 0.0, 0.5]
    weighted = make_rollout_context([["12", "ab"]], reward_funcs=[digit_fraction_reward, lambda completions, **kw:
                                                                  [1.0] * len(completions)], reward_weights=[2.0, 0.5])
    assert weighted.score([0, 1]).tolist() == [2.5, 0.5]
    assert ctx.decode(char_encode("zz"), 0) == [{"role": "assistant", "content": "zz"}]
    assert ctx.gather(torch.ones(2)).tolist() == [1.0, 1.0]  # one process: identity
    assert [e.tolist() for e in ctx.policy_entropies([0, 3])] == [[1.0, 1.0], [1.0, 1.0]] and ctx.entropy_calls == [2]
    text = make_rollout_context(["a", "b"], num_generations=2, sampling_logprob=None, conversational=False)
    assert text.completions == ["a", "b"] and text.sampling_logprobs is None and text.prompts == ["Q0", "Q0"]
    deferred = make_rollout_context([["a", "b"]], deferred=[1])
    assert deferred.deferred == [False, True] and deferred.completion_ids[1] == []


def test_kit_services_with_a_real_tokenizer_and_missing_members():
    tok = tiny_tokenizer()
    ctx = make_rollout_context([["12", "ab"]], tokenizer=tok, eos=True, run=RunInfo(max_completion_length=7))
    assert ctx.tokenizer is tok and ctx.run.max_completion_length == 7 and ctx.mode == "train"
    assert ctx.completion_ids[0] == tok("12", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    template = tok.apply_chat_template(ctx.prompts[0], add_generation_prompt=True, tokenize=False)
    assert ctx.prompt_ids[0] == tok(template, add_special_tokens=False)["input_ids"]  # as TRL tokenizes prompts
    assert ctx.decode(ctx.completion_ids[1], 1) == [{"role": "assistant", "content": "ab"}]  # EOS skipped
    with pytest.raises(PluginError, match="RolloutContext: 'policy_logprobs' is not available"):
        ctx.policy_logprobs([[1]], [[2]])
    chars = make_rollout_context([["ab", "c"]])  # default: the character tokenizer of the kit's ids
    assert chars.tokenizer.decode(chars.completion_ids[0]) == "ab"
    assert chars.tokenizer("ab")["input_ids"] == chars.completion_ids[0]


def test_reward_context_of_one_process_among_several():
    def work(rank, gather):
        ctx = make_reward_context([[0.0], [1.0], [2.0], [3.0]], num_generations=2, num_processes=2,
                                  process_index=rank, completions=["a", "b", "c", "d"], gather=gather)
        return ctx.process_slice, ctx.local_completions, ctx.gather_object([rank])

    (s0, c0, g0), (s1, c1, g1) = run_on_processes(2, work)
    assert (s0, s1) == (slice(0, 2), slice(2, 4)) and (c0, c1) == (["a", "b"], ["c", "d"])
    assert g0 == g1 == [0, 1]


def test_rollout_edits_and_provenance_assertion():
    ctx = make_rollout_context([["abcdef", "ab"], ["xy", "z"]])
    ctx.splice(0, 2, char_encode("QQ"))  # off-policy tokens, NaN sampling log-probs
    ctx.replace_row(1, char_encode("new"), logprobs=[-0.5] * 3)
    ctx.replace_row(2, char_encode("swap"), logprobs=[-0.5] * 4, prompt_swapped=True)
    assert prompt_text(ctx.completions[0]) == "abQQ" and ctx.offpolicy[0] == [False, False, True, True]
    assert ctx.changed == {0, 1, 2}
    assert_offpolicy_logprobs_nan(ctx)
    assert_group_sizes(ctx)
    ctx.sampling_logprobs[0][3] = -0.1
    with pytest.raises(AssertionError, match=r"row 0: off-policy tokens \[3\] have finite sampling log-probs"):
        assert_offpolicy_logprobs_nan(ctx)
    ctx = make_rollout_context([["ab", "cd"]])
    ctx.prompt_swapped[1] = True
    with pytest.raises(AssertionError, match="row 1 is prompt-swapped but has finite sampling log-probs"):
        assert_offpolicy_logprobs_nan(ctx)
    ctx = make_rollout_context([["ab", "cd"]])
    ctx.offpolicy[0] = [True]
    with pytest.raises(AssertionError, match="1 provenance flags for 2 completion tokens"):
        assert_offpolicy_logprobs_nan(ctx)


def test_stub_generation_service():
    service = StubGenerationService()
    out = service.generate(prompts=["p", "q"])
    assert [c.text for c in out] == ["gen1.0", "gen1.1"] and out[0].logprobs == [-1.0] * 6
    assert service.generate(prompts=[]) == [] and service.calls == [["p", "q"], []]
    service = StubGenerationService(respond=lambda prompt, j: "xy", logprob=None, max_completion_length=3)
    (c,) = service.generate(prompt_ids=[[1, 2]], prefix_ids=[char_encode("ab")])
    assert c.completion_ids == char_encode("abx") and c.logprobs is None  # prefix + new, cut to the limit
    (c,) = StubGenerationService(respond=lambda p, j: "z").generate(prompts=["p"], prefix_ids=[[65]])
    assert math.isnan(c.logprobs[0]) and c.logprobs[1] == -1.0  # NaN on the prefix, as the real service
    limited = StubGenerationService(budget=2)
    limited.generate(prompts=["a"])
    assert limited.remaining == 1 and limited.used_this_batch == 1
    with pytest.raises(GenerationBudgetExceeded, match="plugin_generation_budget is 2"):
        limited.generate(prompts=["b", "c"])
    with pytest.raises(Exception, match="exactly one of"):
        service.generate()


class ScaleFirstColumn(Plugin):
    name = "kit_scale_first_column"

    @hookimpl
    def trl_plugins_transform_rewards(self, ctx: RewardContext):
        ctx.rewards_per_func[:, 0] *= 3
        ctx.log_metric("seen_rows", ctx.rewards_per_func.size(0))


def test_reward_context_and_run_hook_with_a_class():
    ctx = make_reward_context([[1.0, 2.0], [0.0, 2.0], [0.5, 2.0], [1.0, 2.0]], num_generations=2,
                              reward_func_names=["acc", "fmt"], reward_weights=[1.0, 0.5])
    assert ctx.group_ids.tolist() == [0, 0, 1, 1] and ctx.index_in_group.tolist() == [0, 1, 0, 1]
    assert ctx.reward_weights.tolist() == [1.0, 0.5] and ctx.gather_object([1, 2]) == [1, 2]
    run_hook(ScaleFirstColumn, "trl_plugins_transform_rewards", ctx)
    assert ctx.rewards_per_func[:, 0].tolist() == [3.0, 0.0, 1.5, 3.0]
    assert ctx.metrics == {"plugins/kit_scale_first_column/seen_rows": [4.0]}
    assert "kit_scale_first_column" not in available_plugins()  # registered only while the stack was built
    assert_group_sizes(ctx)
    ctx.group_ids = torch.tensor([0, 1, 1, 1])
    with pytest.raises(AssertionError, match="group_ids differ"):
        assert_group_sizes(ctx)
    one_column = make_reward_context([1.0, 0.0], num_generations=2)
    assert one_column.rewards_per_func.shape == (2, 1) and one_column.reward_func_names == ["reward_0"]


def test_run_hook_shorthand_hook_names_and_options():
    """run_hook takes the hook without its prefix and one plugin's options directly; both equal the long form."""
    rewards = [1.0, 0.0, 0.0, 1.0]
    long_form = run_hook(ScaleAdvantages, "trl_plugins_transform_advantages",
                         make_advantage_context(rewards, num_generations=2), {"kit_scale_advantages": {"factor": 3.0}})
    short = run_hook(ScaleAdvantages, "transform_advantages", make_advantage_context(rewards, num_generations=2),
                     options={"factor": 3.0})
    default = make_advantage_context(rewards, num_generations=2)
    assert default.advantages.abs().sum() > 0
    torch.testing.assert_close(short.advantages, 3.0 * default.advantages)  # the options reached the plugin
    assert torch.equal(short.advantages, long_form.advantages)
    with pytest.raises(PluginError, match="Unknown hook 'transform_advantage'. Did you mean "
                       "'trl_plugins_transform_advantages'"):
        run_hook(ScaleAdvantages, "transform_advantage", make_advantage_context(rewards, num_generations=2))
    with pytest.raises(PluginError, match="options= is for one plugin"):
        run_hook(["lp_reg", "canon"], "loss", make_loss_context(), options={"kappa": 0.5})


def test_make_tiny_trainer_is_quiet_unless_verbose(tmp_path, capsys):
    trainer = make_tiny_trainer(max_steps=1, output_dir=str(tmp_path), reward_funcs=[digit_fraction_reward])
    trainer.train()
    assert "'loss'" not in capsys.readouterr().out  # TRL's per-step metrics dict is not printed
    assert any("loss" in log for log in trainer.state.log_history)  # ... but logged
    loud = make_tiny_trainer(max_steps=1, output_dir=str(tmp_path / "v"), reward_funcs=[digit_fraction_reward],
                             verbose=True)
    loud.train()
    assert "'loss'" in capsys.readouterr().out


def test_advantage_context_defaults_are_trls():
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.25, 0.0, 0.0, 1.0, 1.0])
    ctx = make_advantage_context(rewards, num_generations=4)
    g = rewards.view(2, 4)
    expected = ((g - g.mean(1, keepdim=True)) / (g.std(1, keepdim=True) + 1e-4)).view(-1)
    torch.testing.assert_close(ctx.advantages, expected)
    centred = (g - g.mean(1, keepdim=True)).view(-1)
    torch.testing.assert_close(group_normalized_advantages(rewards, 4, scale=False), centred)
    assert ctx.rewards_per_func.shape == (8, 1) and ctx.completion_lengths.tolist() == [4.0] * 8
    stats = ctx.policy_stats(head_stats=True)
    assert ctx.policy_stats_calls == [True] and stats.per_token_logps.shape == (8, 4)
    torch.testing.assert_close(stats.mean_entropy, stats.entropies.mean(-1))
    assert torch.equal(ctx.completion_mask(), stats.mask) and ctx.local_completion_ids.shape == (8, 4)
    assert_group_sizes(ctx)
    ctx.extras["bad"] = torch.zeros(5)
    with pytest.raises(AssertionError, match=r"extras\['bad'\] has 5 rows; expected N=8"):
        assert_group_sizes(ctx)
    ctx = make_advantage_context([0.0, 1.0], num_generations=2, advantages=torch.tensor([7.0, 8.0]))
    assert ctx.advantages.tolist() == [7.0, 8.0]


def test_loss_context_defaults_ratio_and_shaped_branch():
    lp = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -1.2, -2.0]], requires_grad=True)
    old = torch.tensor([[-1.5, -2.0, -0.2], [-0.3, -0.2, -2.5]])
    adv = torch.tensor([1.0, -2.0])
    off = torch.tensor([[False, False, False], [False, False, True]])
    ctx = make_loss_context(lp, old_per_token_logps=old, advantages=adv, offpolicy_mask=off, offpolicy_gamma=0.1)
    on_policy = make_loss_context(lp, old_per_token_logps=old, advantages=adv)
    assert ctx.advantages.shape == (2, 1)  # per row, as the framework passes it without loss_advantages hooks
    weights = rules.importance_weights(lp, old, ctx.mask, "token")
    assert torch.equal(ctx.coef_1, weights.coef_1) and torch.equal(ctx.log_ratio, lp - old)
    # off-policy tokens take the framework's shaped branch, every other token the surrogate of the context
    # without off-policy tokens
    shaped = rules.shaped_offpolicy_loss(lp, ctx.advantages, 0.1)
    assert torch.equal(ctx.per_token_loss[off], shaped[off])
    assert torch.equal(ctx.per_token_loss[~off], on_policy.per_token_loss[~off])
    assert ctx.num_items_in_batch == 6 and ctx.completion_ids.shape == (2, 3)
    default = make_loss_context(shape=(3, 5))
    assert default.per_token_logps.requires_grad and default.advantages.flatten().tolist() == [1.0, -1.0, 1.0]
    assert torch.equal(default.old_per_token_logps, default.per_token_logps.detach())
    sequence = make_loss_context(lp, old_per_token_logps=old, advantages=adv, importance_sampling_level="sequence")
    assert sequence.coef_1.shape == (2, 1) and sequence.per_token_loss.shape == (2, 1)


def test_loss_context_sapo_is_the_sigmoid_gate_not_the_clipped_surrogate():
    """The kit once built the clipped surrogate for every loss type but cispo (the trainer comparison below checks
    each type's values against the trainer's loss path)."""
    lp = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -1.2, -2.0]], requires_grad=True)
    old = lp.detach() - 0.1  # ratio 1.105, inside the clip range: the clipped surrogate is -r A
    sapo = make_loss_context(lp, old_per_token_logps=old, loss_type="sapo")
    clipped = make_loss_context(lp, old_per_token_logps=old, loss_type="grpo")
    assert not torch.allclose(sapo.per_token_loss, clipped.per_token_loss)
    hot = make_loss_context(lp, old_per_token_logps=old, loss_type="sapo",
                            loss_options={"sapo_temperature_neg": 5.0})
    assert torch.equal(hot.per_token_loss[0], sapo.per_token_loss[0])  # row 0 has A > 0: positive temperature
    assert not torch.equal(hot.per_token_loss[1], sapo.per_token_loss[1])


def test_loss_context_refuses_unknown_settings():
    with pytest.raises(ValueError, match=r"loss_type='ppo' is unknown; allowed: grpo, bnpo, .*vespo"):
        make_loss_context(loss_type="ppo")
    with pytest.raises(ValueError, match=r"importance_sampling_level='row' is unknown"):
        make_loss_context(importance_sampling_level="row")
    with pytest.raises(ValueError, match=r"unknown loss option\(s\) \['sapo_temp'\]; allowed: delta, sapo_temperature_"):
        make_loss_context(loss_type="sapo", loss_options={"sapo_temp": 2.0})


# ============================================================================================ enabling and calling


@dataclass
class _ProbeOptions(PluginOptions):
    factor: float = option(1.0, min=0.0, help="Multiplier of the advantages.")


class ConfigureProbe(Plugin):
    name = "kit_configure_probe"
    Options = _ProbeOptions
    seen = {}

    @hookimpl
    def trl_plugins_configure(self, trainer, args):
        ConfigureProbe.seen = dict(loss_type=args.loss_type, max_len=trainer.max_completion_length,
                                   plugins=list(args.plugins), G=trainer.num_generations)

    @hookimpl
    def trl_plugins_transform_advantages(self, ctx):
        ctx.advantages = ctx.advantages * self.options.factor


def test_build_stack_validates_options_and_calls_configure():
    stack = build_stack(ConfigureProbe, {"kit_configure_probe": {"factor": 2.0}}, loss_type="dr_grpo",
                        max_completion_length=7)
    assert ConfigureProbe.seen == dict(loss_type="dr_grpo", max_len=7, plugins=["kit_configure_probe"], G=4)
    ctx = make_advantage_context([1.0, 0.0], num_generations=2, advantages=torch.tensor([1.0, -1.0]))
    assert run_hook(stack, "trl_plugins_transform_advantages", ctx).advantages.tolist() == [2.0, -2.0]
    with pytest.raises(PluginConfigError, match="Did you mean 'factor'"):
        build_stack(ConfigureProbe, {"kit_configure_probe": {"facto": 2.0}})
    stack = build_stack(["canon", ConfigureProbe], configure=False)
    assert [p.name for p in stack] == ["canon", "kit_configure_probe"]


def test_run_on_processes_gathers_in_rank_order_and_reports_errors():
    results = run_on_processes(3, lambda rank, gather: gather(torch.tensor([rank, 10 * rank])).tolist())
    assert results == [[0, 0, 1, 10, 2, 20]] * 3

    def skips_the_collective(rank, gather):
        if rank == 1:
            raise ValueError("rank 1 failed before the collective")
        return gather(torch.zeros(1))

    with pytest.raises(ValueError, match="rank 1 failed"):
        run_on_processes(2, skips_the_collective, timeout=5)

    def deadlocks(rank, gather):
        return gather(torch.zeros(1)) if rank == 0 else None  # rank 1 never joins

    with pytest.raises(threading.BrokenBarrierError):
        run_on_processes(2, deadlocks, timeout=1)


def test_builtin_plugin_on_kit_contexts_across_processes():
    """hint_scaffold on two simulated processes: each calls the generation service once per hint level it
    reaches, whether or not it holds a failing group (collective safety)."""
    stack = build_stack("hint_scaffold")

    def process(rank, gather):
        texts = [["1", "x"]] if rank == 0 else [["x", "y"]]  # rank 0's group succeeds (a digit)
        service = StubGenerationService(respond=lambda prompt, j: "7" if "ABCD" in prompt_text(prompt) else "n")
        ctx = make_rollout_context(texts, rows=stub_rows(1, 2, first_group=rank, solution="ABCDEFGH"),
                                   service=service, process_index=rank, gather=gather)
        run_hook(stack, "trl_plugins_after_generation", ctx)
        assert_group_sizes(ctx)
        assert_offpolicy_logprobs_nan(ctx)
        return ctx

    ranks = run_on_processes(2, process)
    assert [len(c.service.calls) for c in ranks] == [2, 2]  # 25 % (no success), then 50 %
    assert not ranks[0].changed and ranks[1].changed == {0, 1}
    assert [a["hint_level"] for a in ranks[1].annotations] == [0.5, 0.5]


# ============================================================================================ against the trainer


class KitLossProbe(Plugin):
    """Contributes every kind of loss term (replacement, weights, token and scalar terms) and keeps the context,
    to compare the kit's composition with the trainer's."""

    name = "kit_loss_probe"
    replaces_surrogate = True
    seen = []

    @staticmethod
    def contribute(ctx):
        T = ctx.mask.size(1)
        ctx.replace_tokens(torch.arange(T).expand_as(ctx.mask) % 5 == 1, 0.3 * ctx.per_token_logps)
        ctx.scale_tokens(torch.linspace(0.5, 1.5, T))
        ctx.add_token_loss(0.01 * ctx.per_token_logps ** 2)
        ctx.add_loss(0.125 * ctx.per_token_logps.mean())

    @hookimpl
    def trl_plugins_loss(self, ctx):
        KitLossProbe.contribute(ctx)
        KitLossProbe.seen.append(ctx)


@pytest.fixture(scope="module")
def probe_batch(loss_batch):
    with temporary_plugin(KitLossProbe):
        trainer = make_tiny_trainer(plugins=["kit_loss_probe"], reward_funcs=[digit_fraction_reward], log_level="error")
        yield trainer, loss_batch(trainer)


def _assert_kit_loss_equals_trainer_loss(trainer, inputs, loss_type, level, options, monkeypatch):
    monkeypatch.setattr(trainer, "loss_type", loss_type)
    monkeypatch.setattr(trainer, "importance_sampling_level", level)
    for name, value in options.items():
        monkeypatch.setattr(trainer.args, name, value)
    KitLossProbe.seen = []
    loss = trainer._compute_loss(trainer.model, inputs)
    (ctx,) = KitLossProbe.seen
    assert inputs["advantages"].abs().sum() > 0
    assert not torch.equal(ctx.coef_1, torch.ones_like(ctx.coef_1))

    kit = make_loss_context(
        ctx.per_token_logps, old_per_token_logps=inputs["old_per_token_logps"], advantages=inputs["advantages"],
        mask=ctx.mask, loss_type=loss_type, epsilon_low=trainer.epsilon_low, epsilon_high=trainer.epsilon_high,
        importance_sampling_level=level, num_items_in_batch=inputs["num_items_in_batch"], loss_options=options,
    )
    assert torch.equal(kit.coef_1, ctx.coef_1)
    assert torch.equal(kit.per_token_loss, ctx.per_token_loss)
    kit.set_active_plugin("kit_loss_probe")
    KitLossProbe.contribute(kit)
    kit_loss = loss_from_context(kit, trainer.max_completion_length)
    assert torch.equal(kit_loss, loss)
    (grad,) = torch.autograd.grad(loss, ctx.per_token_logps, retain_graph=True)
    (kit_grad,) = torch.autograd.grad(kit_loss, ctx.per_token_logps)
    assert torch.equal(kit_grad, grad) and grad.abs().sum() > 0
    return ctx


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", rules.LOSS_TYPES)
def test_kit_loss_equals_the_trainer_loss(probe_batch, loss_type, level, monkeypatch):
    """The kit's context (surrogate of every loss type, importance ratio at both levels) and its loss with every
    kind of plugin contribution equal the trainer's loss path on the same micro-batch, value and gradient."""
    trainer, inputs = probe_batch
    _assert_kit_loss_equals_trainer_loss(trainer, inputs, loss_type, level, {}, monkeypatch)


@pytest.mark.parametrize(
    ("loss_type", "options"),
    [
        ("grpo", {"delta": 1.1}),
        ("sapo", {"sapo_temperature_pos": 1.5, "sapo_temperature_neg": 0.7}),
        ("vespo", {"vespo_k_pos": 1.0, "vespo_lambda_pos": 2.0, "vespo_k_neg": 2.0, "vespo_lambda_neg": 4.0}),
    ],
)
def test_kit_loss_equals_the_trainer_loss_with_loss_options(probe_batch, loss_type, options, monkeypatch):
    trainer, inputs = probe_batch
    ctx = _assert_kit_loss_equals_trainer_loss(trainer, inputs, loss_type, "token", options, monkeypatch)
    monkeypatch.undo()
    default = make_loss_context(ctx.per_token_logps, old_per_token_logps=inputs["old_per_token_logps"],
                                advantages=inputs["advantages"], mask=ctx.mask, loss_type=loss_type)
    assert not torch.equal(default.per_token_loss, ctx.per_token_loss)  # the options do act


class ContractProbe(Plugin):
    """Swaps row 1's prompt, splices row 2, and checks the contracts on the real contexts of every stage."""

    name = "kit_contract_probe"
    checked = []

    @hookimpl
    def trl_plugins_generation_prompts(self, ctx):
        assert_group_sizes(ctx)
        prompt = ctx.prompts[1]
        ctx.generation_prompts[1] = prompt[:-1] + [{**prompt[-1], "content": "another question"}]
        ContractProbe.checked.append("prompt")

    @hookimpl
    def trl_plugins_after_generation(self, ctx):
        ctx.splice(2, 1, [50, 51, 2])
        assert_group_sizes(ctx)
        # inside the hook, rows swapped at the prompt stage still hold the backend's log-probs (the trainer sets
        # them to NaN after the sampling hooks): check the off-policy tokens here, swapped rows on the batch
        assert_offpolicy_logprobs_nan(ctx, prompt_swapped=[False] * len(ctx))
        ContractProbe.checked.append("rollout")

    @hookimpl
    def trl_plugins_transform_rewards(self, ctx):
        assert_group_sizes(ctx)
        ContractProbe.checked.append("reward")

    @hookimpl
    def trl_plugins_transform_advantages(self, ctx):
        assert_group_sizes(ctx)
        ContractProbe.checked.append("advantage")


def _fake_backend(prompt_ids, images, multimodal_fields, num_generations, *args, **kwargs):
    """Stands in for vLLM: completions with per-token sampling log-probs."""
    ids = [[10 + (i + j) % 20 for j in range(5)] + [2] for i in range(len(prompt_ids))]
    return ids, [[-0.1 * (j + 1) for j in range(6)] for _ in prompt_ids]


def test_contracts_hold_on_the_real_contexts_and_batch():
    ContractProbe.checked = []
    with temporary_plugin(ContractProbe):
        trainer = make_tiny_trainer(plugins=["kit_contract_probe"], reward_funcs=[digit_fraction_reward],
                                    log_level="error", per_device_train_batch_size=8)
        trainer._generate_single_turn = _fake_backend
        trainer.model.train()
        ds = trainer.train_dataset
        rows = [dict(ds[k]) for k in range(2) for _ in range(trainer.num_generations)]
        out = trainer._generate_and_score_completions(rows)
    assert ContractProbe.checked == ["prompt", "rollout", "reward", "advantage"]
    swapped = [i == 1 for i in range(8)]
    assert_group_sizes(out, num_generations=4)
    assert_offpolicy_logprobs_nan(out, prompt_swapped=swapped)
    assert out[OFFPOLICY_KEY][2].any() and torch.isnan(out["sampling_per_token_logps"][1]).all()
    broken = dict(out, sampling_per_token_logps=out["sampling_per_token_logps"].nan_to_num(-0.5))
    with pytest.raises(AssertionError, match="off-policy tokens with finite sampling log-probs"):
        assert_offpolicy_logprobs_nan(broken)
    with pytest.raises(AssertionError, match="row 0 is prompt-swapped"):
        assert_offpolicy_logprobs_nan(out, prompt_swapped=[True] + [False] * 7)


# ============================================================================================ reduction to vanilla


class ScaleAdvantages(Plugin):
    name = "kit_scale_advantages"
    Options = _ProbeOptions

    @hookimpl
    def trl_plugins_transform_advantages(self, ctx):
        ctx.advantages = ctx.advantages * self.options.factor


def test_assert_reduces_to_vanilla_passes_in_the_neutral_setting(tmp_path):
    runs = assert_reduces_to_vanilla(ScaleAdvantages, {"factor": 1.0}, loss_types=("dapo",), steps=1,
                                     output_dir=str(tmp_path))
    assert list(runs) == ["dapo"] and len(runs["dapo"].completion_ids) == 1
    assert_group_sizes(runs["dapo"], num_generations=4)


def test_assert_reduces_to_vanilla_fails_when_the_plugin_acts(tmp_path):
    with pytest.raises(AssertionError, match=r"kit_scale_advantages.*does not reduce to trl.GRPOTrainer.*dapo"):
        assert_reduces_to_vanilla(ScaleAdvantages, {"factor": 2.0}, loss_types=("dapo",), steps=1,
                                  output_dir=str(tmp_path))


def test_assert_reduces_to_vanilla_refuses_a_vacuous_comparison(tmp_path):
    def constant(completions, **kwargs):
        return [1.0] * len(completions)

    with pytest.raises(AssertionError, match="vacuous"):
        assert_reduces_to_vanilla(ScaleAdvantages, {"factor": 2.0}, loss_types=("grpo",), steps=1,
                                  reward_funcs=[constant], output_dir=str(tmp_path))

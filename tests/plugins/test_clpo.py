"""clpo (CLPO): difficulty from the group pass rate, rewrite requests and parsing with a scripted generator (also on
two simulated processes), zero-signal groups replaced by pooled rewrites, the reward-stage queue, bad options
refused, the neutral setting reducing to vanilla GRPO, and an end-to-end run whose rewritten problems are verified
against the original answers."""

from __future__ import annotations

import re

import pytest
import torch

from trl_plugins import PluginConfigError, build_plugins
from trl_plugins.api.services import RunInfo
from trl_plugins.api.text import stable_key
from trl_plugins.testing import (
    StubGenerationService,
    assert_reduces_to_vanilla,
    build_stack,
    make_advantage_context,
    make_loss_context,
    make_refill_context,
    make_reward_context,
    make_rollout_context,
    make_tiny_trainer,
    run_hook,
    run_on_processes,
    script_generation,
    stub_rows,
)
from trl_plugins.tasks.tiny import build_and_save
from trl_plugins_builtin.clpo import (
    KL_KEY,
    ClpoOptions,
    difficulty,
    hard_rows,
    kl_multipliers,
    parse_rewrite,
    replacement_slots,
    rewritten_row,
)

pytestmark = pytest.mark.filterwarnings("ignore")


def _plugin(**options):
    """The clpo plugin of a built (unconfigured) stack; its ``stack`` attribute runs its hooks like the trainer."""
    stack = build_stack("clpo", {"clpo": options}, configure=False)
    plugin = stack.plugins[0]
    plugin.stack = stack
    return plugin


def test_difficulty_bands_follow_the_official_thresholds_and_modes():
    rates = torch.tensor([0.0, 0.25, 0.3, 0.5, 0.7, 0.75, 1.0], dtype=torch.float64)
    assert difficulty(rates, ClpoOptions()) == ["hard", "hard", "hard", "medium", "medium", None, None]
    assert difficulty(rates, ClpoOptions(rewrite_mode="hard_only")) == ["hard"] * 3 + [None] * 4
    assert difficulty(rates, ClpoOptions(rewrite_mode="medium_only")) == [None] * 3 + ["medium"] * 2 + [None] * 2


def test_parse_rewrite_takes_the_first_code_block_or_the_reply_within_the_length_bounds():
    assert parse_rewrite("Sure:\n```text\nWhat is 2 plus 3?\n```\nbye") == "What is 2 plus 3?"
    assert parse_rewrite("  What is the sum of 2 and 3?  ") == "What is the sum of 2 and 3?"
    assert parse_rewrite("```\nshort\n```") is None  # 5 characters: under the official bound
    assert parse_rewrite("x" * 2000) is None
    assert parse_rewrite("```\nAn unclosed block is read to its end") == "An unclosed block is read to its end"


def test_a_rewritten_row_keeps_every_column_but_the_problem_text():
    row = {"prompt": [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}], "answer": "5"}
    new = rewritten_row(row, "Q'")
    assert new == {"prompt": [{"role": "system", "content": "S"}, {"role": "user", "content": "Q'"}], "answer": "5"}
    assert row["prompt"][1]["content"] == "Q"  # the original is untouched


def _reply(prompt, j):
    text = prompt[-1]["content"] if isinstance(prompt, list) else prompt
    question = text.split("Problem:\n", 1)[1]
    return "```\n" + ("too" if question == "Q1" else f"A clearer {question} statement") + "\n```"


def test_after_generation_rewrites_the_queue_with_the_answer_named_and_pools_valid_rewrites():
    plugin = _plugin()
    rows = stub_rows(2, 2, answer=["7", "9"])
    plugin.queue = [{"kind": "hard", "row": rows[0]}, {"kind": "medium", "row": rows[2]}]
    service = StubGenerationService(_reply)
    ctx = make_rollout_context([["a", "b"], ["c", "d"]], rows=rows, service=service)
    run_hook(plugin.stack, "trl_plugins_after_generation", ctx)
    (call,) = service.calls
    assert "easier to read" in call[0][0]["content"] and "still 7" in call[0][0]["content"]
    assert "different words" in call[1][0]["content"] and "still 9" in call[1][0]["content"]
    assert plugin.pool == [{"kind": "hard", "row": {"prompt": [{"role": "user", "content": "A clearer Q0 statement"}],
                                                    "answer": "7"}}]  # Q1's rewrite "too" is too short
    assert plugin.queue == []
    assert ctx.metrics["plugins/clpo/rewrite_valid_fraction"] == [0.5]
    ctx2 = make_rollout_context([["a", "b"]], rows=rows[:2], service=StubGenerationService(_reply))
    run_hook(plugin.stack, "trl_plugins_after_generation", ctx2)
    assert ctx2.service.calls == []  # empty queue (the same on every process): no call at all


def test_rewrites_are_shared_out_over_processes_and_gathered_alike():
    rows = stub_rows(4, 2, answer=["1", "2", "3", "4"])
    queue = [{"kind": "hard", "row": rows[2 * g]} for g in range(3)]

    def work(rank, gather):
        plugin = _plugin()
        plugin.queue = list(queue)
        local = rows[4 * rank: 4 * rank + 4]
        ctx = make_rollout_context(["x"] * 4, num_generations=2, rows=local, process_index=rank, gather=gather,
                                   run=RunInfo(num_processes=2), service=StubGenerationService(_reply))
        run_hook(plugin.stack, "trl_plugins_after_generation", ctx)
        return [len(c) for c in ctx.service.calls], plugin.pool

    (calls0, pool0), (calls1, pool1) = run_on_processes(2, work)
    assert calls0 == [2] and calls1 == [1]  # items 0, 2 on process 0; item 1 on process 1; one call each
    assert pool0 == pool1
    assert [item["row"]["prompt"][0]["content"] for item in pool0] == [
        "A clearer Q0 statement", "A clearer Q2 statement"]  # Q1's reply (from process 1) is too short


def test_zero_signal_groups_are_replaced_by_pooled_rewrites_hard_first_up_to_the_share():
    acc = torch.tensor([0, 0, 1, 0, 1, 1, 0, 0, 1, 1], dtype=torch.float32)  # G=2: rates 0, .5, 1, 0, 1
    plugin = _plugin(max_share=0.4)  # round(0.4 * 5) = 2 slots at most
    medium = {"kind": "medium", "row": {"prompt": "M", "answer": "1"}}
    hard = {"kind": "hard", "row": {"prompt": "H", "answer": "2"}}
    plugin.pool = [medium, hard, dict(hard, row={"prompt": "H2", "answer": "3"})]
    ctx = run_hook(plugin.stack, "trl_plugins_reject_groups", make_refill_context(acc, num_generations=2))
    assert ctx.rejected.tolist() == [True, False, True, False, False]
    assert ctx.replacements == [("row", {"prompt": "H", "answer": "2"}), ("row", {"prompt": "H2", "answer": "3"})]
    assert plugin.pool == [medium] and plugin.supplied == {stable_key("H"): "hard", stable_key("H2"): "hard"}
    assert ctx.metrics["plugins/clpo/rewritten_fraction"] == [0.4]
    later = run_hook(plugin.stack, "trl_plugins_reject_groups", make_refill_context(acc, num_generations=2, round=1))
    assert not later.rejected.any() and plugin.pool == [medium]  # round 0 only
    assert replacement_slots(torch.tensor([0.0, 1.0]), torch.tensor([False, True]), 5, 5) == [1]


def test_reward_stage_queues_the_hard_and_medium_originals_and_leaves_rewards_alone():
    plugin = _plugin()
    rows = stub_rows(4, 2, answer=["1", "2", "3", "4"])
    plugin.supplied = {stable_key(rows[6]["prompt"]): "medium"}  # group 3 is a rewrite placed in this batch
    acc = torch.tensor([1, 0, 0, 0, 1, 1, 0, 0], dtype=torch.float32)  # rates .5, 0, 1, 0
    ctx = make_reward_context(acc, num_generations=2, rows=rows)
    before = ctx.rewards_per_func.clone()
    run_hook(plugin.stack, "trl_plugins_transform_rewards", ctx)
    assert torch.equal(ctx.rewards_per_func, before)
    assert [(q["kind"], q["row"]["answer"]) for q in plugin.queue] == [("hard", "2"), ("medium", "1")]
    assert ctx.metrics["plugins/clpo/rewritten_pass_rate"] == [0.0]
    assert ctx.metrics["plugins/clpo/hard_fraction"] == [0.5]
    # difficulty-aware KL: group 1 (rate 0) is hard; group 3 (rate 0) is a medium rewrite, so not hard
    assert plugin._hard.tolist() == [False, False, True, True, False, False, False, False]
    run_hook(plugin.stack, "trl_plugins_transform_rewards", make_reward_context(acc, num_generations=2, rows=rows,
                                                                          mode="eval"))
    assert len(plugin.queue) == 2  # evaluation batches are not a curriculum signal


@pytest.mark.parametrize("options, match", [
    ({"rewrite_mode": "all"}, "rewrite_mode"),
    ({"hard_upper": 1.5}, "hard_upper"),
    ({"max_share": -0.1}, "max_share"),
    ({"kl_hard_scale": -0.5}, "kl_hard_scale"),
    ({"medium_lower": 0.8, "medium_upper": 0.5}, "medium_lower=0.8 is above medium_upper=0.5"),
    ({"hard_template": "Simplify this."}, "must contain {question}"),
    ({"medium_template": "{question} {answr}"}, "answr"),
])
def test_bad_options_are_refused_at_construction(options, match):
    with pytest.raises(PluginConfigError, match=match):
        build_plugins(["clpo"], {"clpo": options})


def test_no_refill_round_is_refused():
    with pytest.raises(PluginConfigError, match="max_refill_rounds=0; allowed: >= 1"):
        make_tiny_trainer(plugins=["clpo"], max_refill_rounds=0)


@pytest.mark.parametrize("neutral", [{"rewrite_mode": "off", "kl_hard_scale": 1.0},
                                     {"max_share": 0.0, "kl_hard_scale": 1.0}])
def test_neutral_setting_reduces_to_vanilla_grpo(neutral):
    assert_reduces_to_vanilla("clpo", neutral, loss_types=("grpo",))


def test_neutral_kl_factors_with_a_reference_kl_reduce_to_vanilla(tmp_path):
    # beta = 0.04: the reference KL is on; factors 1 / 1 leave TRL's KL term as it is (no clpo hook runs)
    model = str(build_and_save(tmp_path / "tiny"))
    assert_reduces_to_vanilla("clpo", {"rewrite_mode": "off", "kl_hard_scale": 1.0}, loss_types=("grpo",),
                              model=model, beta=0.04, steps=1)


def test_hard_rows_follow_the_official_labels_and_set_the_kl_factor():
    rates = torch.tensor([0.0, 0.3, 0.5, 0.0, 1.0], dtype=torch.float64)
    kinds = [None, None, None, "medium", "hard"]  # groups 3 and 4 are placed rewrites
    hard = hard_rows(rates, kinds, 0.3, 2)
    assert hard.tolist() == [True, True, True, True, False, False, False, False, True, True]
    o = ClpoOptions(kl_hard_scale=0.5, kl_nonhard_scale=2.0)
    assert kl_multipliers(hard, o).tolist() == [0.5] * 4 + [2.0] * 4 + [0.5] * 2


def test_loss_term_scales_the_reference_kl_of_hard_rows():
    plugin = _plugin(rewrite_mode="off")  # the KL half alone (official defaults: 0.5 hard, 1 otherwise)
    acc = torch.tensor([0, 0, 1, 0, 1, 1], dtype=torch.float32)  # rates 0 (hard), .5, 1
    rows = stub_rows(3, 2, answer=["1", "2", "3"])
    run_hook(plugin.stack, "trl_plugins_transform_rewards", make_reward_context(acc, num_generations=2, rows=rows))
    assert plugin.queue == []  # rewriting is off
    adv = make_advantage_context(acc.tolist(), num_generations=2)
    run_hook(plugin.stack, "trl_plugins_transform_advantages", adv)
    assert adv.extras[KL_KEY].tolist() == [0.5, 0.5, 1.0, 1.0, 1.0, 1.0]
    assert adv.metrics["plugins/clpo/kl_hard_fraction"] == [pytest.approx(1 / 3)]
    lp = torch.tensor([[-1.0, -2.0], [-1.5, -0.5], [-0.3, -0.9]], requires_grad=True)
    ref = torch.tensor([[-1.2, -1.0], [-1.0, -0.7], [-0.1, -2.0]])
    ctx = make_loss_context(lp, beta=0.04, ref_per_token_logps=ref,
                            extras={KL_KEY: adv.extras[KL_KEY][[0, 2, 4]]})
    ctx.set_active_plugin("clpo")
    plugin.trl_plugins_loss(ctx)
    (term,) = ctx.token_terms
    kl = torch.exp(ref - lp) - (ref - lp) - 1
    assert torch.allclose(term, 0.04 * torch.tensor([[-0.5], [0.0], [0.0]]) * kl)  # total: beta * 0.5 * KL
    off = make_loss_context(lp, extras={KL_KEY: torch.tensor([0.5, 1.0, 1.0])})  # beta = 0: nothing to scale
    plugin.trl_plugins_loss(off)
    assert off.token_terms == []
    evaluation = make_advantage_context(acc.tolist(), num_generations=2, mode="eval")
    run_hook(plugin.stack, "trl_plugins_transform_advantages", evaluation)
    assert KL_KEY not in evaluation.extras


def test_rewritten_problems_enter_the_next_batch_and_are_verified_against_the_original_answers():
    """Originals are always failed (hard, zero signal); the policy's rewrites are answered right half the time:
    the second batch replaces its zero-signal groups by the rewrites, whose pass rate 0.5 proves the original answers
    verified them."""
    from trl_plugins.testing import tiny_dataset

    data = tiny_dataset(8)
    answers = {re.search(r"Compute (\S+) ", r["prompt"][0]["content"]).group(1): r["answer"] for r in data}

    def script(prompt, row):
        if "Problem:\n" in prompt:
            expr = re.search(r"Compute (\S+) ", prompt).group(1)
            return f"```\nEvaluate {expr} from the left.\n```"
        rewritten = re.search(r"Evaluate (\S+) from the left", prompt)
        if rewritten and row % 2 == 0:
            return f"Answer: {answers[rewritten.group(1)]}"
        return "Answer: -999"

    trainer = make_tiny_trainer(plugins=["clpo"], dataset=data, per_device_train_batch_size=8, max_steps=2,
                                max_completion_length=48,
                                max_refill_rounds=1)
    script_generation(trainer, script)
    trainer.train()
    logs = {}
    for log in trainer.state.log_history:
        for k, v in log.items():
            logs.setdefault(k, []).append(v)
    assert logs["plugins/clpo/rewritten_fraction"] == [0.0, 1.0]
    assert logs["plugins/clpo/rewritten_pass_rate"] == [0.5]
    assert logs["plugins/clpo/rewrite_valid_fraction"] == [1.0]

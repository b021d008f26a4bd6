"""The refill stage (``trl_plugins_reject_groups``): reduction when nothing is rejected, rounds and limits, named
replacements, the rollout count, the resumable refill stream, and bad configuration refused at construction."""

from __future__ import annotations

import warnings

import pytest
import torch

from trl_plugins import GenerationBudgetExceeded, Plugin, PluginConfigError, PluginError, hookimpl
from trl_plugins.runtime.refill import RefillStream, zero_group_advantages
from trl_plugins.testing import (
    assert_reduces_to_vanilla,
    digit_fraction_reward,
    make_tiny_trainer,
    record_run,
    temporary_plugin,
)

pytestmark = pytest.mark.filterwarnings("ignore")


class RejectNothing(Plugin):
    """Implements the hook (so the refill stage is built) and rejects nothing."""

    name = "test_reject_nothing"
    calls: list = []

    @hookimpl
    def trl_plugins_reject_groups(self, ctx):
        RejectNothing.calls.append(ctx.round)


class RejectEverything(Plugin):
    """Rejects every fresh group in every round; records the rounds it saw."""

    name = "test_reject_everything"
    seen: list = []

    @hookimpl
    def trl_plugins_reject_groups(self, ctx):
        RejectEverything.seen.append((ctx.round, int(ctx.fresh.sum())))
        ctx.reject(ctx.fresh)


class RepeatAndSupply(Plugin):
    """Round 0: rejects groups 0 and 1; group 0 becomes group 2's prompt again, group 1 a supplied row."""

    name = "test_repeat_supply"
    supplied: dict = {}
    keys: list = []

    @hookimpl
    def trl_plugins_reject_groups(self, ctx):
        if ctx.round == 0:
            ctx.reject([0, 1])
            ctx.repeat(2)
            ctx.supply(RepeatAndSupply.supplied)

    @hookimpl
    def trl_plugins_transform_advantages(self, ctx):
        RepeatAndSupply.keys.append(ctx.pool_ids().tolist())


def _metrics(trainer) -> dict:
    merged = {}
    for log in trainer.state.log_history:
        merged.update({k: v for k, v in log.items() if k.startswith("plugins/framework/")})
    return merged


def test_nothing_rejected_reduces_to_vanilla_grpo():
    RejectNothing.calls = []
    runs = assert_reduces_to_vanilla(RejectNothing, loss_types=("dapo",))
    assert RejectNothing.calls == [0, 0]  # one round per generation batch, nothing refilled
    logs = {k: v for log in runs["dapo"].logs for k, v in log.items()}
    assert logs["plugins/framework/refill_rounds"] == 0 and logs["plugins/framework/refill_rollouts"] == 0


def test_rejecting_everything_stops_at_the_round_limit_and_counts_every_rollout():
    RejectEverything.seen = []
    with temporary_plugin(RejectEverything):
        trainer = make_tiny_trainer(plugins=["test_reject_everything"], max_steps=1, max_refill_rounds=2)
        trainer.train()
    assert RejectEverything.seen == [(0, 1), (1, 1), (2, 1)]  # 4 rows, G = 4: one group, fresh in every round
    m = _metrics(trainer)
    assert m["plugins/framework/refill_rounds"] == 2
    assert m["plugins/framework/rejected_groups"] == 3  # rounds 0, 1 and the limit round
    assert m["plugins/framework/refill_rollouts"] == 2 * 4
    assert m["plugins/framework/kept_at_limit"] == 1
    assert trainer.generation_service.total == 8  # the rollout budget counter sees every refill rollout
    assert trainer.refill_stage.stream.state_dict() == {"epoch": 0, "position": 2}


def test_zero_advantage_at_the_limit_zeroes_the_kept_groups():
    with temporary_plugin(RejectEverything):
        trainer = make_tiny_trainer(
            plugins=["test_reject_everything"], reward_funcs=[digit_fraction_reward], max_steps=1,
            max_refill_rounds=1, refill_at_limit="zero_advantage",
        )
        run = record_run(trainer)
    assert torch.all(run.advantages[0] == 0)
    assert any(r.std() > 0 for r in run.rewards)  # the reward had signal: the zeros come from the limit rule
    assert _metrics(trainer)["plugins/framework/zero_advantage_groups"] == 1


def test_error_at_the_limit_names_the_setting():
    with temporary_plugin(RejectEverything):
        trainer = make_tiny_trainer(
            plugins=["test_reject_everything"], max_steps=1, max_refill_rounds=0, refill_at_limit="error"
        )
        with pytest.raises(PluginError, match="max_refill_rounds=0.*refill_at_limit='error'"):
            trainer.train()


def test_named_replacements_fill_slots_before_the_stream_and_share_prompt_keys():
    from trl_plugins.testing import tiny_dataset

    RepeatAndSupply.keys = []
    RepeatAndSupply.supplied = dict(tiny_dataset(20)[17])  # a row of another dataset: not in the training set
    prompts = []
    with temporary_plugin(RepeatAndSupply):
        trainer = make_tiny_trainer(
            plugins=["test_repeat_supply"], per_device_train_batch_size=6, num_generations=2, max_steps=1
        )
        original = trainer._calculate_rewards

        def spy(inputs, prompts_, completions, ids):
            prompts.append([p[-1]["content"] for p in prompts_])
            return original(inputs, prompts_, completions, ids)

        trainer._calculate_rewards = spy
        trainer.train()
    (final,) = prompts
    groups = [final[i] for i in range(0, 6, 2)]
    assert all(final[i] == final[i + 1] for i in range(0, 6, 2))  # G rows per group, one prompt each
    assert groups[0] == groups[2]  # slot 0 repeats slot 2's prompt
    assert groups[1] == RepeatAndSupply.supplied["prompt"][-1]["content"]
    (keys,) = RepeatAndSupply.keys
    assert keys[0] == keys[4] and keys[2] != keys[0]  # the repeated group pools with its source
    assert _metrics(trainer)["plugins/framework/refill_rollouts"] == 4
    assert trainer.refill_stage.stream.state_dict()["position"] == 0  # nothing drawn from the stream


def test_a_supplied_row_without_the_dataset_columns_is_an_error():
    class SupplyBare(Plugin):
        name = "test_supply_bare"

        @hookimpl
        def trl_plugins_reject_groups(self, ctx):
            if ctx.round == 0:
                ctx.reject([0])
                ctx.supply({"prompt": "1+1="})

    with temporary_plugin(SupplyBare):
        trainer = make_tiny_trainer(plugins=["test_supply_bare"], max_steps=1)
        with pytest.raises(PluginError, match="lacks the columns .*answer"):
            trainer.train()


def test_refill_stream_is_deterministic_and_resumes_from_its_state():
    a = RefillStream(5, seed=3)
    first = a.draw(7)
    assert sorted(first[:5]) == list(range(5)) and len(first) == 7  # one epoch, then the next permutation
    b = RefillStream(5, seed=3)
    b.draw(4)
    c = RefillStream(5, seed=3)
    c.load_state_dict(b.state_dict())
    assert c.draw(3) == first[4:7]
    assert RefillStream(5, seed=3, shuffle=False).draw(6) == [0, 1, 2, 3, 4, 0]


def test_resumed_run_draws_what_the_unbroken_run_drew(tmp_path):
    def trainer(out):
        return make_tiny_trainer(
            plugins=["test_reject_everything"], max_steps=3, max_refill_rounds=1, output_dir=str(out),
            save_strategy="steps", save_steps=1,
        )

    with temporary_plugin(RejectEverything):
        unbroken = trainer(tmp_path / "a")
        unbroken.train()
        resumed = trainer(tmp_path / "b")
        resumed.train(resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-2"))
    assert unbroken.refill_stage.stream.state_dict() == {"epoch": 0, "position": 3}
    assert resumed.refill_stage.stream.state_dict() == unbroken.refill_stage.stream.state_dict()
    assert resumed.generation_service.total == unbroken.generation_service.total == 12


def test_zero_group_advantages_hits_only_the_named_groups():
    adv = torch.arange(1.0, 7.0)  # local rows 6..11 of a batch with G=2 (process 1 of 2)
    out = zero_group_advantages(adv, [3, 5], 2, slice(6, 12))
    assert out.tolist() == [0.0, 0.0, 3.0, 4.0, 0.0, 0.0]
    tokens = zero_group_advantages(torch.ones(6, 3), [4], 2, slice(6, 12))
    assert tokens.sum(dim=1).tolist() == [3.0, 3.0, 0.0, 0.0, 3.0, 3.0]


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("max_refill_rounds", -1, "max_refill_rounds must be an integer >= 0; got -1"),
        ("max_refill_rounds", 1.5, "max_refill_rounds must be an integer >= 0; got 1.5"),
        ("refill_at_limit", "drop", "refill_at_limit must be one of keep, zero_advantage, error; got 'drop'"),
    ],
)
def test_bad_refill_settings_are_refused_at_construction(field, value, match):
    from trl_plugins.testing import tiny_config

    with pytest.raises(PluginConfigError, match=match):
        tiny_config(**{field: value})


def test_refill_refuses_an_iterable_dataset():
    from datasets import Dataset

    data = Dataset.from_list([{"prompt": "1+1=", "answer": "2"}] * 8).to_iterable_dataset()
    with warnings.catch_warnings(), temporary_plugin(RejectNothing):
        warnings.simplefilter("ignore")
        with pytest.raises(PluginConfigError, match="iterable training dataset"):
            make_tiny_trainer(plugins=["test_reject_nothing"], dataset=data, max_steps=1)


def test_refill_rollouts_count_in_the_per_batch_generation_budget():
    with temporary_plugin(RejectEverything):
        ok = make_tiny_trainer(plugins=["test_reject_everything"], max_steps=2, max_refill_rounds=1,
                               plugin_generation_budget=4)
        ok.train()  # 4 refill rollouts per batch: within the budget in every batch (the count restarts per batch)
        assert ok.generation_service.total == 8
        over = make_tiny_trainer(plugins=["test_reject_everything"], max_steps=1, max_refill_rounds=2,
                                 plugin_generation_budget=4)
        with pytest.raises(GenerationBudgetExceeded, match="plugin_generation_budget is 4"):
            over.train()


def test_nothing_rejected_adds_no_collective_and_no_reward_call():
    """The cost statement: with a refill plugin that rejects nothing, every step makes the same all-gathers and the
    same reward-function calls as a run without plugins (the first round's scoring is TRL's own, moved earlier)."""

    def run(plugins):
        calls = {"gather": 0, "reward_rows": 0}

        def reward(completions, **kwargs):
            calls["reward_rows"] += len(completions)
            return digit_fraction_reward(completions)

        with temporary_plugin(RejectNothing):
            trainer = make_tiny_trainer(plugins=plugins, reward_funcs=[reward], max_steps=2)
            gather = trainer.accelerator.gather

            def counting(tensor):
                calls["gather"] += 1
                return gather(tensor)

            trainer.accelerator.gather = counting
            trainer.train()
        return calls

    plain, refill = run([]), run(["test_reject_nothing"])
    assert refill == plain and plain["reward_rows"] == 2 * 4

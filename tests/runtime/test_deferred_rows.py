"""Deferred rows (PromptContext.defer): rows left out of the trainer's first generation round and filled later in
the step, so a two-round method keeps exactly G rollouts per group (FBOS-RL's equal budget)."""

import pytest
import torch
import trl

from trl_plugins import Plugin, PluginError, hookimpl
from trl_plugins.testing import digit_fraction_reward, make_tiny_trainer, temporary_plugin

G = 4


def _backend(calls):
    """Stands in for TRL's backend (patched on the class, below the trainer's per-row override)."""

    def fake(self, prompt_ids, images, multimodal_fields, num_generations, *args, **kwargs):
        calls.append((len(prompt_ids), num_generations))
        return [[10 + i % 7, 11, 2] for i in range(len(prompt_ids))], [[-0.5, -0.5, -0.5] for _ in prompt_ids]

    return fake


class DeferHalf(Plugin):
    """Defers the second half of every group; fills it from the generation service unless told not to."""

    name = "test_defer_half"
    fill = True
    seen = {}

    @hookimpl
    def trl_plugins_generation_prompts(self, ctx):
        for i in range(len(ctx.rows)):
            if ctx.index_in_group[i] >= G // 2:
                ctx.defer(i)

    @hookimpl
    def trl_plugins_after_generation(self, ctx):
        late = [i for i, d in enumerate(ctx.deferred) if d]
        DeferHalf.seen = {"deferred": list(ctx.deferred), "empty": [ctx.completion_ids[i] for i in late]}
        if not DeferHalf.fill:
            return
        for i, c in zip(late, ctx.service.generate(prompts=[ctx.prompts[i] for i in late])):
            ctx.replace_row(i, c.completion_ids, logprobs=c.logprobs)


def _rows(trainer, n):
    ds = trainer.train_dataset
    return [dict(ds[k]) for k in range(n) for _ in range(G)]


@pytest.fixture
def trainer():
    with temporary_plugin(DeferHalf):
        DeferHalf.fill = True
        t = make_tiny_trainer(plugins=["test_defer_half"], reward_funcs=[digit_fraction_reward], log_level="error")
        yield t


def test_deferred_rows_are_sampled_once_in_the_second_round(trainer, monkeypatch):
    calls = []
    monkeypatch.setattr(trl.GRPOTrainer, "_generate_single_turn", _backend(calls))
    trainer.model.train()
    out = trainer._generate_and_score_completions(_rows(trainer, 2))
    assert calls == [(4, 1), (4, 1)]  # 2 prompts x (G/2 first round + G/2 second round): G per prompt in total
    assert DeferHalf.seen["deferred"] == [False, False, True, True] * 2
    assert DeferHalf.seen["empty"] == [[]] * 4  # placeholders until filled
    assert out["completion_ids"].size(0) == 2 * G and bool(out["completion_mask"].sum(1).gt(0).all())
    assert trainer.generation_service.used_this_batch == 4


def test_unfilled_deferred_rows_are_an_error(trainer, monkeypatch):
    DeferHalf.fill = False
    monkeypatch.setattr(trl.GRPOTrainer, "_generate_single_turn", _backend([]))
    trainer.model.train()
    with pytest.raises(PluginError, match=r"Rows \[2, 3\] were deferred"):
        trainer._generate_and_score_completions(_rows(trainer, 1))


def test_first_round_is_padded_to_the_largest_process(trainer, monkeypatch):
    """Another process keeps more first-round rows: this one pads its first round to the same count."""
    calls = []
    monkeypatch.setattr(trl.GRPOTrainer, "_generate_single_turn", _backend(calls))
    real_gather = trainer.accelerator.gather

    def gather(tensor):
        if tensor.dim() == 1 and tensor.numel() == 1 and not tensor.dtype.is_floating_point:
            other = torch.full_like(tensor, 3) if int(tensor) == 2 else tensor  # first-round count 3 elsewhere
            return torch.cat([tensor, other])
        return real_gather(tensor)

    monkeypatch.setattr(trainer.accelerator, "gather", gather)
    trainer.model.train()
    out = trainer._generate_and_score_completions(_rows(trainer, 1))
    assert calls[0] == (3, 1)  # 2 real first-round rows + 1 dropped padding row
    assert out["completion_ids"].size(0) == G

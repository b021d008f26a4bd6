"""Whole groups per loss micro-batch (``Plugin.needs_whole_groups``): the group shuffle, the construction check and
the micro-batches a loss plugin sees on the tiny model."""

from __future__ import annotations

import pytest
import torch

from trl_plugins import IncompatiblePluginsError, LossContext, Plugin, hookimpl
from trl_plugins.api.errors import PluginError
from trl_plugins.runtime.whole_groups import group_permutation, permute_rows
from trl_plugins.testing import make_loss_context, make_tiny_trainer, temporary_plugin


@pytest.mark.parametrize("rows, G", [(8, 2), (12, 4), (6, 6), (5, 1)])
def test_group_permutation_moves_whole_groups_and_draws_like_trl(rows, G):
    torch.manual_seed(3)
    perm = group_permutation(rows, G)
    after = torch.rand(3)
    torch.manual_seed(3)
    row_perm = torch.randperm(rows)
    assert torch.equal(torch.rand(3), after), "the random stream after the shuffle must be TRL's"
    assert sorted(perm.tolist()) == list(range(rows))
    groups = perm.view(-1, G)
    assert torch.equal(groups - groups[:, :1], torch.arange(G).expand_as(groups))  # consecutive, in order
    assert torch.all(groups[:, 0] % G == 0)
    firsts = [int(r) // G for r in row_perm]
    assert (groups[:, 0] // G).tolist() == list(dict.fromkeys(firsts))  # groups in order of first appearance


def test_group_permutation_refuses_partial_groups():
    with pytest.raises(ValueError, match="7 rows do not split into groups of 2"):
        group_permutation(7, 2)


def test_permute_rows_keeps_scalars_and_permutes_lists():
    batch = {"x": torch.arange(4), "n": torch.tensor(9), "names": ["a", "b", "c", "d"], "none": None}
    out = permute_rows(batch, torch.tensor([2, 3, 0, 1]))
    assert out["x"].tolist() == [2, 3, 0, 1] and out["names"] == ["c", "d", "a", "b"]
    assert out["n"].item() == 9 and out["none"] is None


def test_group_rows_needs_the_declaration():
    ctx = make_loss_context(shape=(4, 3))
    with pytest.raises(PluginError, match="needs_whole_groups"):
        ctx.group_rows(ctx.mask)
    ctx = make_loss_context(shape=(4, 3), num_generations=2)
    assert ctx.group_rows(ctx.mask).shape == (2, 2, 3)


class _GroupProbe(Plugin):
    """Records, per loss micro-batch, the prompt of each row and the G the context reports."""

    name = "test_group_probe"
    multi_turn = True
    needs_whole_groups = True
    seen: list = []

    @hookimpl
    def trl_plugins_loss(self, ctx: LossContext):
        prompts = [tuple(row[m.bool()].tolist()) for row, m in zip(ctx.inputs["prompt_ids"], ctx.inputs["prompt_mask"])]
        type(self).seen.append((ctx.num_generations, prompts, ctx.group_rows(ctx.advantages.expand_as(ctx.mask))))
        ctx.log_metric("seen", 1.0)


def test_micro_batches_hold_whole_groups_end_to_end(tmp_path):
    """Eight rows (four groups of two) split into two micro-batches of four rows: each holds two whole groups, rows of a
    group consecutive (same prompt), and the two micro-batches together hold every group once."""
    _GroupProbe.seen = []
    with temporary_plugin(_GroupProbe):
        trainer = make_tiny_trainer(plugins=["test_group_probe"], per_device_train_batch_size=4, num_generations=2,
                                    gradient_accumulation_steps=2, max_steps=2, output_dir=str(tmp_path))
        assert trainer.whole_groups == 2
        trainer.train()
    assert len(_GroupProbe.seen) == 4  # two optimiser steps of two micro-batches
    for i in (0, 2):  # each generation batch
        groups = []
        for G, prompts, adv in _GroupProbe.seen[i:i + 2]:
            assert G == 2 and len(prompts) == 4
            assert prompts[0] == prompts[1] and prompts[2] == prompts[3]
            groups += [prompts[0], prompts[2]]
            assert torch.allclose(adv.sum(dim=(1, 2)), torch.zeros(2), atol=1e-5)  # a group's advantages sum to 0
        assert len(set(groups)) == 4  # four distinct prompts: every group once


def test_without_the_declaration_rows_are_shuffled_as_in_trl(tmp_path):
    trainer = make_tiny_trainer(plugins=["lp_reg"], output_dir=str(tmp_path))
    assert trainer.whole_groups is None


def test_batch_sizes_that_cannot_hold_whole_groups_are_refused(tmp_path):
    with temporary_plugin(_GroupProbe):
        with pytest.raises(IncompatiblePluginsError,
                           match=r"'test_group_probe'.*per_device_train_batch_size=2 is not a multiple of "
                                 r"num_generations=4.*Allowed: a multiple of 4"):
            make_tiny_trainer(plugins=["test_group_probe"], per_device_train_batch_size=2, num_generations=4,
                              gradient_accumulation_steps=2, output_dir=str(tmp_path))

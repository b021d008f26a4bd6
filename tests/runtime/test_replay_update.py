"""The replay update (AdvantageContext.schedule_replay_update, trl_plugins.runtime.replay_update): the placement plan,
ReplayRow refused at construction on bad input, and the update itself on the tiny model, checked against a gradient
computed here from the formula (TRL's clipped surrogate with the stored old log-probs, the run's aggregation) and one
SGD step. The two-process run (rows that do not divide over the processes) is in tests/engines/test_replay_update_ddp.py;
SPEAR's use of it in tests/plugins/test_replay.py."""

import math

import pytest
import torch

from trl_plugins.api import Plugin, PluginError, ReplayRow, hookimpl
from trl_plugins.runtime.replay_update import plan_replay_steps
from trl_plugins.testing import make_tiny_trainer, temporary_plugin, tiny_model


# ------------------------------------------------------------------------------------------ plan
def test_the_plan_spreads_rows_over_processes_then_micro_batches():
    plan = plan_replay_steps(5, processes=2, accumulation=2, micro=4)
    assert plan == [[[[0, 4], [2]], [[1], [3]]]]  # one step; slots 0..3 = (p0 m0), (p1 m0), (p0 m1), (p1 m1)
    plan = plan_replay_steps(9, processes=1, accumulation=1, micro=4)
    assert [len(step[0][0]) for step in plan] == [4, 4, 1]
    plan = plan_replay_steps(1, processes=2, accumulation=2, micro=3)
    assert plan == [[[[0], []], [[], []]]]  # micro-batches without a row run one zero-weight row
    assert plan_replay_steps(0, 2, 2, 2) == []


@pytest.mark.parametrize("n, P, A, M", [(17, 2, 3, 2), (24, 3, 2, 4), (7, 4, 1, 1)])
def test_every_row_is_trained_once_and_no_micro_batch_overflows(n, P, A, M):
    plan = plan_replay_steps(n, P, A, M)
    seen = [r for step in plan for proc in step for micro in proc for r in micro]
    assert sorted(seen) == list(range(n))
    assert len(plan) == math.ceil(n / (P * A * M))
    assert all(len(step) == P and all(len(proc) == A for proc in step) for step in plan)
    assert all(len(micro) <= M for step in plan for proc in step for micro in proc)


# ------------------------------------------------------------------------------------------ ReplayRow
def _row(**changes):
    values = dict(prompt_ids=[5, 6], completion_ids=[7, 8, 9], loss_mask=[1, 0, 1], old_logprobs=[-0.5, None, -1.0],
                  advantage=0.5)
    values.update(changes)
    return ReplayRow(**values)


def test_a_replay_row_stores_nan_off_the_mask_and_round_trips():
    r = _row()
    assert r.old_logprobs[0] == -0.5 and math.isnan(r.old_logprobs[1])
    back = ReplayRow.from_state(r.state())
    assert back.completion_ids == r.completion_ids and back.advantage == 0.5


@pytest.mark.parametrize("changes, match", [
    ({"prompt_ids": []}, "prompt_ids is empty"),
    ({"completion_ids": [], "loss_mask": [], "old_logprobs": []}, "completion_ids is empty"),
    ({"loss_mask": [1, 1]}, "2 loss-mask values and 3 log-probs for 3 completion tokens"),
    ({"loss_mask": [1, 3, 1]}, "loss_mask value 3; allowed: 0"),
    ({"loss_mask": [0, 0, 0]}, "with at least one trained token"),
    ({"old_logprobs": [0.5, None, -1.0]}, "old log-prob 0.5 at trained token 0"),
    ({"old_logprobs": [-0.5, None, float("nan")]}, "old log-prob nan at trained token 2"),
    ({"advantage": float("inf")}, "advantage inf; allowed: a finite number"),
])
def test_bad_replay_rows_are_refused_at_construction(changes, match):
    with pytest.raises(PluginError, match=match):
        _row(**changes)


# ------------------------------------------------------------------------------------------ the update
def _rows(tokenizer, n: int) -> list[ReplayRow]:
    g = torch.Generator().manual_seed(3)
    prompt = tokenizer.encode("12+3=", add_special_tokens=False)
    rows = []
    for k in range(n):
        L = 3 + k % 3
        completion = torch.randint(3, 40, (L,), generator=g).tolist()
        mask = [1] * L
        if L > 3:
            mask[1] = 0  # a token the loss does not train (as a tool result)
        old = (-0.1 - 2.5 * torch.rand(L, generator=g)).tolist()
        rows.append(ReplayRow(prompt, completion, mask, old, advantage=(1.0 if k % 2 == 0 else -0.5) * (k + 1) / n))
    return rows


def _scheduling_plugin(rows):
    class ScheduleOnce(Plugin):
        name = "test_schedule_replay"

        @hookimpl
        def trl_plugins_transform_advantages(self, ctx):
            if ctx.mode == "train" and ctx.step == 0 and rows:
                ctx.schedule_replay_update(rows)

    return ScheduleOnce


def _trained(rows, **config):
    with temporary_plugin(_scheduling_plugin(rows)):
        trainer = make_tiny_trainer(plugins=["test_schedule_replay"], **{
            "optim": "sgd", "learning_rate": 0.05, "max_grad_norm": 0.0, "lr_scheduler_type": "constant",
            "max_steps": 1, **config})
        trainer.train()
    return trainer


def _manual_replay_loss(model, rows, plan_step, loss_type, A, temperature):
    """The replay loss of one step on one process, written from the formula: -min(r A, clip(r, 0.8, 1.2) A) per
    token, r = exp(log pi - old); grpo: each micro-batch's mean over rows of the masked token-mean, / A; dapo: the
    masked token-sum over the loss tokens of the whole step."""
    total_tokens = sum(sum(rows[r].loss_mask) for micro in plan_step for r in micro)
    loss = 0.0
    for micro in plan_step:
        terms = []
        for r in micro:
            row = rows[r]
            ids = torch.tensor([row.prompt_ids + row.completion_ids])
            logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[0].float() / temperature
            P, L = len(row.prompt_ids), len(row.completion_ids)
            logp = torch.log_softmax(logits[P - 1:P - 1 + L], -1).gather(1, torch.tensor(row.completion_ids)[:, None])[:, 0]
            old = torch.nan_to_num(torch.tensor(row.old_logprobs), nan=0.0)
            ratio = torch.exp(logp - old)
            token = -torch.min(ratio * row.advantage, ratio.clamp(0.8, 1.2) * row.advantage)
            mask = torch.tensor(row.loss_mask, dtype=torch.float32)
            terms.append((token * mask).sum() / (mask.sum() if loss_type == "grpo" else total_tokens))
        if terms:
            loss = loss + (torch.stack(terms).mean() / A if loss_type == "grpo" else torch.stack(terms).sum())
    return loss


@pytest.mark.parametrize("loss_type, accumulation, n_rows", [("grpo", 2, 3), ("dapo", 1, 3), ("grpo", 1, 4)])
def test_the_replay_update_is_one_sgd_step_on_the_replay_loss(loss_type, accumulation, n_rows):
    """The same run with and without scheduled rows: the difference of the final weights is -lr times the gradient
    of the replay loss (written out above) at the weights after the batch's own step (one replay step: <= 4 rows
    per micro-batch)."""
    config = dict(loss_type=loss_type, gradient_accumulation_steps=accumulation,
                  per_device_train_batch_size=4 // accumulation)
    without = _trained([], **config)
    rows = _rows(without.processing_class, n_rows)
    with_rows = _trained(rows, **config)
    plan = plan_replay_steps(len(rows), 1, accumulation, with_rows.args.per_device_train_batch_size)
    assert len(plan) == 1
    # a fresh model with the weights after the batch's own step (a deepcopy would keep accelerate's forward wrapper,
    # bound to the trainer's model)
    model = tiny_model(without.processing_class)
    model.load_state_dict(without.model.state_dict())
    _manual_replay_loss(model, rows, plan[0][0], loss_type, accumulation, without.args.temperature).backward()
    for (name, p0), p1 in zip(model.named_parameters(), with_rows.model.parameters()):
        expected = p0.detach() - 0.05 * (p0.grad if p0.grad is not None else torch.zeros_like(p0))
        torch.testing.assert_close(p1.detach(), expected, atol=2e-6, rtol=1e-5, msg=name)
    logged = with_rows.state.log_history[0]
    assert logged["plugins/framework/replay_update_rows"] == n_rows
    assert logged["plugins/framework/replay_update_steps"] == 1
    assert "plugins/framework/replay_update_rows" not in without.state.log_history[0]


def test_more_rows_than_one_step_holds_take_several_optimizer_steps_without_a_scheduler_step():
    trainer = _trained(None, per_device_train_batch_size=4)  # builds the tokenizer; no rows
    rows = _rows(trainer.processing_class, 9)
    trainer = _trained(rows, per_device_train_batch_size=4)
    logged = trainer.state.log_history[0]
    assert logged["plugins/framework/replay_update_steps"] == 3  # ceil(9 / 4)
    assert trainer.state.global_step == 1 and trainer.lr_scheduler.last_epoch == 1


def test_scheduling_in_eval_is_refused():
    from trl_plugins.testing import make_advantage_context

    ctx = make_advantage_context(torch.tensor([1.0, 0.0]), num_generations=2, mode="eval")
    with pytest.raises(PluginError, match="only in training"):
        ctx.schedule_replay_update([_row()])


@pytest.mark.parametrize("config", [dict(steps_per_generation=2), dict(num_iterations=2)])
def test_the_update_waits_for_the_last_optimizer_step_that_trains_its_batch(config):
    """A generation batch trained over two optimizer steps (two steps per generation, or two passes over it): the rows
    scheduled at its advantage stage train after the second step, not the first."""
    probe = _trained(None)
    rows = _rows(probe.processing_class, 2)
    trainer = _trained(rows, max_steps=2, **config)
    logged = [h for h in trainer.state.log_history if "loss" in h]
    assert [h.get("plugins/framework/replay_update_rows", 0) for h in logged] == [0, 2]


def test_rows_pending_at_a_checkpoint_are_saved_and_train_after_the_first_batch_of_the_resumed_run(tmp_path):
    """Two optimizer steps per generation batch, a checkpoint after the first: the rows scheduled for the batch's end
    are in the checkpoint's plugin state (loadable without code: weights_only), and the resumed run (TRL starts a
    fresh generation batch) trains them after that batch's two steps."""
    from trl_plugins.runtime.checkpoints import PLUGIN_STATE_FILE

    probe = _trained(None)
    rows = _rows(probe.processing_class, 2)
    config = dict(steps_per_generation=2, save_strategy="steps", save_steps=1)
    with temporary_plugin(_scheduling_plugin(rows)):
        first = make_tiny_trainer(plugins=["test_schedule_replay"], max_steps=1, output_dir=str(tmp_path / "a"),
                                  **config)
        first.train()
        assert len(first.replay_update.rows) == 2  # scheduled, not yet due
        saved = torch.load(tmp_path / "a" / "checkpoint-1" / PLUGIN_STATE_FILE, weights_only=True)
        saved_rows = [ReplayRow.from_state(r) for r in saved["__framework__"]["replay_update"]["rows"]]
        for got, want in zip(saved_rows, rows, strict=True):  # old_logprobs hold NaN off the mask: compared as tensors
            assert (got.prompt_ids, got.completion_ids, got.loss_mask, got.advantage) == (
                want.prompt_ids, want.completion_ids, want.loss_mask, want.advantage)
            torch.testing.assert_close(torch.tensor(got.old_logprobs), torch.tensor(want.old_logprobs), equal_nan=True)
        resumed = make_tiny_trainer(plugins=["test_schedule_replay"], max_steps=3, output_dir=str(tmp_path / "b"),
                                    **config)
        resumed.train(resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-1"))
    logged = [h for h in resumed.state.log_history if "loss" in h]
    # step 1 (the checkpoint's history), then the resumed steps 2 and 3: the restored rows train after step 3
    assert [h.get("plugins/framework/replay_update_rows", 0) for h in logged] == [0, 0, 2]
    assert resumed.replay_update.rows == []


def test_rows_that_differ_between_processes_are_refused_on_every_process():
    """Two processes scheduling different rows (here: one advantage differs) both raise, naming what differs; the same
    rows pass."""
    from types import SimpleNamespace

    from trl_plugins.runtime.replay_update import ReplayUpdate
    from trl_plugins.testing import run_on_processes

    def work(rank, gather, advantages):
        acc = SimpleNamespace(num_processes=2, device=torch.device("cpu"), gather=gather)
        trainer = SimpleNamespace(accelerator=acc, args=SimpleNamespace(steps_per_generation=1), num_iterations=1,
                                  micro_step=0)
        update = ReplayUpdate(trainer)
        try:
            update.schedule([_row(advantage=advantages[rank])])
        except PluginError as error:
            return str(error)
        return None

    errors = run_on_processes(2, lambda rank, gather: work(rank, gather, (0.5, 0.25)))
    assert all(e and "scheduled different rows (row counts [1, 1], contents different)" in e for e in errors)
    same = run_on_processes(2, lambda rank, gather: work(rank, gather, (0.5, 0.5)))
    assert same == [None, None]

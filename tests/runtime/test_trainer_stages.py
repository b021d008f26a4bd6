"""The four stages wired into the trainer: prompt swap and provenance (sampling), group integrity, reward
columns and transforms, advantage chains and their per-row extras, the generation service, and stacking."""

import math

import pytest
import torch
import trl

from trl_plugins import GenerationBudgetExceeded, Plugin, PluginConfigError, PluginError, hookimpl
from trl_plugins.api.collectives import CAUSE_BYTES
from trl_plugins.api.contexts import OFFPOLICY_KEY
from trl_plugins.testing import digit_fraction_reward, make_tiny_trainer, temporary_plugin

G = 4


def _with_content(prompt, content):
    """A copy of a conversational prompt whose last (user) message says ``content``."""
    return [dict(m) for m in prompt[:-1]] + [{**prompt[-1], "content": content}]


def _rows(trainer, n_prompts, start=0):
    """A local generation batch as TRL's sampler builds it: each dataset row repeated G times, groups contiguous."""
    ds = trainer.train_dataset
    return [dict(ds[start + k]) for k in range(n_prompts) for _ in range(G)]


def _generate(trainer, rows):
    trainer.model.train()
    return trainer._generate_and_score_completions(rows)


def _tokenized(trainer, prompt):
    """Generation-prompt token ids of a conversational prompt, built independently of TRL's helper."""
    tok = trainer.processing_class
    text = tok.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
    return tok(text, add_special_tokens=False)["input_ids"]


def _unpad_left(ids, mask):
    return [row[m.bool()].tolist() for row, m in zip(ids, mask)]


class RewardRecorder:
    """A reward function that records what TRL passes it (and scores the digit fraction)."""

    def __init__(self):
        self.calls = []
        self.__name__ = "recorded_reward"

    def __call__(self, prompts, completions, completion_ids, **kwargs):
        values = digit_fraction_reward(completions)
        self.calls.append({"prompts": prompts, "completions": completions, "values": values})
        return values


# ============================================================================================ (a) prompt swap


class SwapPrompts(Plugin):
    """Row-specific generation prompts (different within a group); training prompts: original / declared."""

    name = "test_swap_prompts"

    @staticmethod
    def generation(prompt, k):
        return _with_content(prompt, f"{prompt[-1]['content']} [g{k}]")

    @staticmethod
    def declared(prompt, g):
        return _with_content(prompt, f"train on row {g}")

    @hookimpl
    def trl_plugins_generation_prompts(self, ctx):
        for i, prompt in enumerate(ctx.prompts):
            k, g = ctx.index_in_group[i], ctx.global_index[i]
            if k == 3:  # sampled and trained under the same new prompt: no swap
                ctx.generation_prompts[i] = ctx.training_prompts[i] = self.declared(prompt, g)
                continue
            ctx.generation_prompts[i] = self.generation(prompt, k)
            if k == 1:
                ctx.training_prompts[i] = self.declared(prompt, g)  # k == 0, 2: keep the original training prompt


def test_prompt_swap_training_ids_generation_and_rewards(monkeypatch):
    reward = RewardRecorder()
    calls = []
    original_single_turn = trl.GRPOTrainer._generate_single_turn

    def single_turn(self, prompt_ids, images, multimodal_fields, num_generations, *args, **kwargs):
        calls.append((list(map(list, prompt_ids)), num_generations))
        return original_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, *args, **kwargs)

    monkeypatch.setattr(trl.GRPOTrainer, "_generate_single_turn", single_turn)
    seen = {}

    class Inspect(Plugin):
        name = "test_inspect_rollout"

        @hookimpl
        def trl_plugins_after_generation(self, ctx):
            seen["swapped"] = list(ctx.prompt_swapped)
            seen["training_prompts"] = list(ctx.training_prompts)

    with temporary_plugin(SwapPrompts), temporary_plugin(Inspect):
        trainer = make_tiny_trainer(
            plugins=["test_swap_prompts", "test_inspect_rollout"], reward_funcs=[reward], log_level="error",
            per_device_train_batch_size=2 * G,
        )
        rows = _rows(trainer, 2)
        out = _generate(trainer, rows)

    originals = [r["prompt"] for r in rows]
    declared = []
    for i, p in enumerate(originals):
        k = i % G
        declared.append(SwapPrompts.declared(p, i) if k in (1, 3) else p)
    generation = [SwapPrompts.declared(p, i) if i % G == 3 else SwapPrompts.generation(p, i % G) for i, p in enumerate(originals)]

    # training prompt ids in the batch are exactly the declared training prompts, row by row
    assert _unpad_left(out["prompt_ids"], out["prompt_mask"]) == [_tokenized(trainer, p) for p in declared]
    # one generation call, one completion per row, from the row's own generation prompt
    assert len(calls) == 1
    prompt_ids, num_generations = calls[0]
    assert num_generations == 1
    assert prompt_ids == [_tokenized(trainer, p) for p in generation]
    assert seen["swapped"] == [i % G in (0, 1, 2) for i in range(2 * G)]
    assert seen["training_prompts"] == declared
    # reward functions see the original prompts
    assert reward.calls[-1]["prompts"] == originals
    assert out["completion_ids"].size(0) == 2 * G


def test_no_prompt_change_keeps_grouped_generation(monkeypatch):
    calls = []
    original_single_turn = trl.GRPOTrainer._generate_single_turn

    def single_turn(self, prompt_ids, images, multimodal_fields, num_generations, *args, **kwargs):
        calls.append(num_generations)
        return original_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, *args, **kwargs)

    monkeypatch.setattr(trl.GRPOTrainer, "_generate_single_turn", single_turn)

    class Noop(Plugin):
        name = "test_noop_prompts"

        @hookimpl
        def trl_plugins_generation_prompts(self, ctx):
            ctx.annotations[0]["touched"] = True

    with temporary_plugin(Noop):
        trainer = make_tiny_trainer(plugins=["test_noop_prompts"], reward_funcs=[digit_fraction_reward], log_level="error")
        rows = _rows(trainer, 1)
        out = _generate(trainer, rows)
    assert calls == [G]
    assert _unpad_left(out["prompt_ids"], out["prompt_mask"]) == [_tokenized(trainer, r["prompt"]) for r in rows]


def test_per_row_generation_is_decided_across_processes(monkeypatch):
    """Another process changed its generation prompts: this one must take the per-row path too (same calls)."""
    calls = []
    original_single_turn = trl.GRPOTrainer._generate_single_turn

    def single_turn(self, prompt_ids, images, multimodal_fields, num_generations, *args, **kwargs):
        calls.append(num_generations)
        return original_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, *args, **kwargs)

    monkeypatch.setattr(trl.GRPOTrainer, "_generate_single_turn", single_turn)

    class Noop(Plugin):
        name = "test_noop_prompts"

        @hookimpl
        def trl_plugins_generation_prompts(self, ctx):
            pass

    with temporary_plugin(Noop):
        trainer = make_tiny_trainer(plugins=["test_noop_prompts"], reward_funcs=[digit_fraction_reward], log_level="error")
        real_gather = trainer.accelerator.gather

        def gather(tensor):  # the (1,) "did my prompts differ" flag gets a 1 from the simulated other process
            if tensor.dim() == 1 and tensor.numel() == 1 and not tensor.dtype.is_floating_point:
                return torch.cat([tensor, torch.ones_like(tensor)])
            return real_gather(tensor)

        monkeypatch.setattr(trainer.accelerator, "gather", gather)
        _generate(trainer, _rows(trainer, 1))
    assert calls == [1]


# ============================================================================================ (b) NaN sampling logps


def _fake_single_turn(calls=None, length=6):
    """Stands in for the generation backend: returns ids and per-token log-probs, as vLLM would."""

    def fake(prompt_ids, images, multimodal_fields, num_generations, *args, **kwargs):
        if calls is not None:
            calls.append([list(p) for p in prompt_ids])
        completion_ids = [[10 + (i + j) % 20 for j in range(length - 1)] + [2] for i in range(len(prompt_ids))]
        logprobs = [[-0.1 * (j + 1) - 0.01 * i for j in range(length)] for i in range(len(prompt_ids))]
        return completion_ids, logprobs

    return fake


SPLICE_AT = 3
REPLACED_LPS = [-0.7, -0.8, -0.9]


class ProvenancePlugin(Plugin):
    """Row 1: prompt swap. Row 2: off-policy splice. Row 3: replaced, on-policy, with its own log-probs. Row 0: kept."""

    name = "test_provenance"

    @hookimpl
    def trl_plugins_generation_prompts(self, ctx):
        ctx.generation_prompts[1] = _with_content(ctx.prompts[1], "a different question")

    @hookimpl
    def trl_plugins_after_generation(self, ctx):
        ctx.splice(2, SPLICE_AT, [50, 51, 52, 2])
        ctx.replace_row(3, [60, 61, 2], offpolicy=False, logprobs=REPLACED_LPS)


@pytest.fixture
def provenance_trainer():
    with temporary_plugin(ProvenancePlugin):
        trainer = make_tiny_trainer(plugins=["test_provenance"], reward_funcs=[digit_fraction_reward], log_level="error")
        trainer._generate_single_turn = _fake_single_turn()
        yield trainer


def _assert_provenance(out):
    fake_ids, fake_lps = _fake_single_turn()([[0]] * G, None, {}, 1)
    lps = out["sampling_per_token_logps"]
    mask = out["completion_mask"].bool()
    assert lps.shape == out["completion_ids"].shape
    # row 0: untouched, keeps the backend's log-probs
    torch.testing.assert_close(lps[0][mask[0]], torch.tensor(fake_lps[0]))
    # row 1: sampled under another prompt than it is trained on -> NaN everywhere
    assert torch.isnan(lps[1][mask[1]]).all()
    # row 2: prefix keeps its log-probs, spliced tokens are NaN and flagged off-policy
    n2 = int(mask[2].sum())
    assert n2 == SPLICE_AT + 4
    torch.testing.assert_close(lps[2, :SPLICE_AT], torch.tensor(fake_lps[2][:SPLICE_AT]))
    assert torch.isnan(lps[2, SPLICE_AT:n2]).all()
    assert out["completion_ids"][2, :n2].tolist() == fake_ids[2][:SPLICE_AT] + [50, 51, 52, 2]
    expected_off = torch.zeros_like(mask)
    expected_off[2, SPLICE_AT:n2] = True
    assert torch.equal(out[OFFPOLICY_KEY], expected_off)
    # row 3: replaced on-policy with known log-probs -> kept
    torch.testing.assert_close(lps[3][mask[3]], torch.tensor(REPLACED_LPS))


def test_nan_sampling_logps_on_swapped_rows_and_offpolicy_tokens(provenance_trainer):
    out = _generate(provenance_trainer, _rows(provenance_trainer, 1))
    _assert_provenance(out)


def test_offpolicy_and_swapped_tokens_get_no_vllm_is_correction(provenance_trainer, monkeypatch):
    """With vLLM IS correction on, TRL's ratio is exactly 1 where the sampling log-prob is NaN."""
    trainer = provenance_trainer
    monkeypatch.setattr(trainer, "use_vllm", True)
    monkeypatch.setattr(trainer, "vllm_importance_sampling_correction", True)
    monkeypatch.setattr(trainer, "vllm_importance_sampling_mode", "token_truncate")
    out = _generate(trainer, _rows(trainer, 1))
    _assert_provenance(out)
    ratio = out["importance_sampling_ratio"]
    mask = out["completion_mask"].bool()
    nan = torch.isnan(out["sampling_per_token_logps"]) & mask
    assert nan.any()
    assert torch.equal(ratio[nan], torch.ones_like(ratio[nan]))
    # elsewhere the correction is live (the fake log-probs are not the model's)
    assert (ratio[mask & ~nan] != 1).any()


# ============================================================================================ (c) groups


class ReplaceRows(Plugin):
    """Replaces the first two rows of every group (new completions, one off-policy) and records the layout."""

    name = "test_replace_rows"
    seen = {}

    @hookimpl
    def trl_plugins_after_generation(self, ctx):
        ReplaceRows.seen = dict(
            global_index=list(ctx.global_index), group_ids=list(ctx.group_ids),
            index_in_group=list(ctx.index_in_group), n=len(ctx),
        )
        digits = ctx.tokenizer("1234567", add_special_tokens=False)["input_ids"]
        for i in range(len(ctx)):
            if ctx.index_in_group[i] == 0:
                ctx.replace_row(i, digits)
            elif ctx.index_in_group[i] == 1:
                ctx.replace_row(i, digits[:3], offpolicy=True)


def test_groups_keep_exactly_g_rows_after_replacement():
    reward = RewardRecorder()
    with temporary_plugin(ReplaceRows):
        trainer = make_tiny_trainer(
            plugins=["test_replace_rows"], reward_funcs=[reward], log_level="error", per_device_train_batch_size=3 * G,
        )
        rows = _rows(trainer, 3)
        captured = []
        original = trainer._calculate_rewards
        trainer._calculate_rewards = lambda *a, **k: captured.append(original(*a, **k)) or captured[-1]
        out = _generate(trainer, rows)

    N = 3 * G
    assert ReplaceRows.seen == dict(
        global_index=list(range(N)), group_ids=[g // G for g in range(N)], index_in_group=[g % G for g in range(N)], n=N
    )
    assert out["completion_ids"].size(0) == out["prompt_ids"].size(0) == out["advantages"].size(0) == N
    prompts = reward.calls[-1]["prompts"]
    assert len(prompts) == N
    for group in range(3):
        block = prompts[group * G : (group + 1) * G]
        assert all(p == rows[group * G]["prompt"] for p in block)
    completions = reward.calls[-1]["completions"]
    assert all(completions[g][-1]["content"] == "1234567" for g in range(0, N, G))
    assert all(completions[g][-1]["content"] == "123" for g in range(1, N, G))
    # advantages are normalised within each group of G consecutive rows
    rewards = captured[-1][:, 0].view(-1, G)
    expected = (rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-4)
    torch.testing.assert_close(out["advantages"], expected.view(-1), atol=1e-5, rtol=1e-4)
    assert out[OFFPOLICY_KEY][1::G, :3].all() and not out[OFFPOLICY_KEY][0::G].any()


def test_replace_row_never_changes_group_size():
    """The context has no API that adds or drops rows: a plugin can only replace them in place."""
    from trl_plugins import RolloutContext

    public = {n for n in dir(RolloutContext) if not n.startswith("_")}
    assert not public & {"append", "insert", "pop", "remove", "add_row", "drop_row", "extend"}


# ============================================================================================ (d) reward stage


class DoubleFirstColumn(Plugin):
    name = "test_double_rewards"
    seen = {}

    @hookimpl
    def trl_plugins_transform_rewards(self, ctx):
        DoubleFirstColumn.seen = dict(
            names=list(ctx.reward_func_names), weights=ctx.reward_weights.tolist(),
            group_ids=ctx.group_ids.tolist(), index_in_group=ctx.index_in_group.tolist(),
            before=ctx.rewards_per_func.clone(), process_slice=ctx.process_slice,
        )
        ctx.rewards_per_func[:, 0] *= 2
        ctx.log_metric("doubled", 1.0)


def test_transform_rewards_feeds_trl_advantages_and_metrics():
    reward = RewardRecorder()
    with temporary_plugin(DoubleFirstColumn):
        trainer = make_tiny_trainer(
            plugins=["test_double_rewards"], reward_funcs=[reward], log_level="error",
            per_device_train_batch_size=2 * G, scale_rewards="none",
        )
        out = _generate(trainer, _rows(trainer, 2))
    raw = torch.tensor(reward.calls[-1]["values"])
    seen = DoubleFirstColumn.seen
    assert seen["names"] == ["recorded_reward"] and seen["weights"] == [1.0]
    assert seen["group_ids"] == [g // G for g in range(2 * G)] and seen["index_in_group"] == [g % G for g in range(2 * G)]
    assert seen["process_slice"] == slice(0, 2 * G)
    torch.testing.assert_close(seen["before"][:, 0], raw)
    doubled = (2 * raw).view(-1, G)
    assert raw.abs().sum() > 0
    torch.testing.assert_close(out["advantages"], (doubled - doubled.mean(1, keepdim=True)).view(-1))
    metrics = trainer._metrics["train"]
    assert metrics["rewards/recorded_reward/mean"][-1] == pytest.approx(2 * raw.mean().item(), rel=1e-5)
    assert metrics["plugins/test_double_rewards/doubled"] == [1.0]


def length_bonus(completions, **kwargs):
    return [0.5 for _ in completions]


def weighted_bonus(completions, **kwargs):
    return [1.0 for _ in completions]


weighted_bonus.reward_weight = 0.25


class BonusColumns(Plugin):
    name = "test_bonus_columns"
    funcs = [length_bonus]

    @hookimpl
    def trl_plugins_reward_functions(self, args):
        return list(BonusColumns.funcs)


def test_plugin_reward_function_adds_named_column_and_weight():
    BonusColumns.funcs = [length_bonus]
    with temporary_plugin(BonusColumns):
        trainer = make_tiny_trainer(
            plugins=["test_bonus_columns"], reward_funcs=[digit_fraction_reward], log_level="error", max_steps=1,
        )
        assert trainer.reward_func_names == ["digit_fraction_reward", "length_bonus"]
        assert trainer.reward_weights.tolist() == [1.0, 1.0]
        logs = []
        trainer.add_callback(_LogRecorder(logs))
        trainer.train()
    merged = {k: v for log in logs for k, v in log.items()}
    assert merged["rewards/length_bonus/mean"] == pytest.approx(0.5)
    assert "rewards/digit_fraction_reward/mean" in merged


def test_plugin_reward_weights_extend_user_weights():
    BonusColumns.funcs = [length_bonus, weighted_bonus]
    with temporary_plugin(BonusColumns):
        trainer = make_tiny_trainer(
            plugins=["test_bonus_columns"], reward_funcs=[digit_fraction_reward], log_level="error", reward_weights=[2.0],
        )
        assert trainer.reward_func_names == ["digit_fraction_reward", "length_bonus", "weighted_bonus"]
        assert trainer.reward_weights.tolist() == [2.0, 1.0, 0.25]
        # weights given by the plugin alone (no user weights)
        trainer = make_tiny_trainer(plugins=["test_bonus_columns"], reward_funcs=[digit_fraction_reward], log_level="error")
        assert trainer.reward_weights.tolist() == [1.0, 1.0, 0.25]
        with pytest.raises(PluginConfigError, match="reward_weights has 2 entries for 1 reward functions"):
            make_tiny_trainer(
                plugins=["test_bonus_columns"], reward_funcs=[digit_fraction_reward], reward_weights=[1.0, 1.0],
            )
    BonusColumns.funcs = [length_bonus]


def test_plugin_reward_weights_do_not_leak_into_a_reused_config():
    """One config can build several trainers (e.g. side-by-side runs): extending the weights must not stick."""
    from trl_plugins import PluginGRPOTrainer
    from trl_plugins.testing import tiny_config, tiny_dataset, tiny_model, tiny_tokenizer

    BonusColumns.funcs = [length_bonus, weighted_bonus]
    with temporary_plugin(BonusColumns):
        for user_weights in (None, [2.0]):
            args = tiny_config(plugins=["test_bonus_columns"], reward_weights=user_weights, log_level="error")
            tokenizer = tiny_tokenizer()
            for _ in range(2):
                trainer = PluginGRPOTrainer(
                    model=tiny_model(tokenizer), reward_funcs=[digit_fraction_reward], args=args,
                    train_dataset=tiny_dataset(), processing_class=tokenizer,
                )
                assert trainer.reward_weights.tolist() == [(user_weights or [1.0])[0], 1.0, 0.25]
                assert args.reward_weights == user_weights
    BonusColumns.funcs = [length_bonus]


class _LogRecorder:
    """A minimal TrainerCallback that keeps every log dict."""

    def __init__(self, logs):
        self.logs = logs

    def __getattr__(self, name):  # every other callback event is a no-op
        if name.startswith("on_"):
            return lambda *a, **k: None
        raise AttributeError(name)

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append(dict(logs or {}))


# ============================================================================================ (e) advantage stage


class RowIndexAdvantages(Plugin):
    """Sets advantages from the global row index and attaches the index as a per-row extra."""

    name = "test_row_advantages"
    token_level = False

    @hookimpl
    def trl_plugins_transform_advantages(self, ctx):
        N = ctx.advantages.size(0)
        index = torch.arange(N, dtype=torch.float32)
        if RowIndexAdvantages.token_level:
            T = ctx.completion_mask().size(1)
            ctx.advantages = index.unsqueeze(1) * 100 + torch.arange(T, dtype=torch.float32)
        else:
            ctx.advantages = index * 0.1 - 0.3
        ctx.extras["foo"] = index
        ctx.extras["pair"] = torch.stack([index, -index], dim=1)  # (N, 2) extras ride along too
        local = torch.arange(ctx.process_slice.start, ctx.process_slice.stop, dtype=torch.float32)
        ctx.set_local_extra("local_foo", local)


class ExtrasProbe(Plugin):
    name = "test_extras_probe"
    seen: list = []

    @hookimpl
    def trl_plugins_loss(self, ctx):
        ExtrasProbe.seen.append(
            dict(extras={k: v.clone() for k, v in ctx.extras.items()}, advantages=ctx.advantages.detach().clone(),
                 T=ctx.per_token_logps.size(1))
        )


@pytest.mark.parametrize("token_level", [False, True])
def test_advantage_extras_ride_with_their_rows_through_the_shuffle(token_level):
    RowIndexAdvantages.token_level = token_level
    ExtrasProbe.seen = []
    with temporary_plugin(RowIndexAdvantages), temporary_plugin(ExtrasProbe):
        trainer = make_tiny_trainer(
            plugins=["test_row_advantages", "test_extras_probe"], reward_funcs=[digit_fraction_reward],
            log_level="error", per_device_train_batch_size=4, steps_per_generation=2, gradient_accumulation_steps=2,
            max_steps=1,
        )
        trainer.train()
    assert len(ExtrasProbe.seen) == 2  # two shuffled micro-batches of one generation batch
    foos = []
    for batch in ExtrasProbe.seen:
        foo = batch["extras"]["foo"]
        assert foo.shape == (4,)
        assert torch.equal(batch["extras"]["pair"], torch.stack([foo, -foo], dim=1))
        assert torch.equal(batch["extras"]["local_foo"], foo)
        adv = batch["advantages"]
        if token_level:
            T = batch["T"]
            assert adv.shape == (4, T)
            torch.testing.assert_close(adv, foo.unsqueeze(1) * 100 + torch.arange(T, dtype=torch.float32))
        else:
            torch.testing.assert_close(adv[:, 0], foo * 0.1 - 0.3)
        foos.extend(foo.long().tolist())
    assert sorted(foos) == list(range(8))
    assert foos != list(range(8)), "TRL's shuffle should have reordered the rows (else the check is vacuous)"


class ChainRecorder:
    calls: list = []


class DoubleAdv(Plugin):
    name = "test_adv_double"

    @hookimpl
    def trl_plugins_transform_advantages(self, ctx):
        ChainRecorder.calls.append(("double", ctx.advantages.clone()))
        ctx.advantages = ctx.advantages * 2


class ShiftAdv(Plugin):
    name = "test_adv_shift"

    @hookimpl
    def trl_plugins_transform_advantages(self, ctx):
        ChainRecorder.calls.append(("shift", ctx.advantages.clone()))
        ctx.advantages = ctx.advantages + 1


@pytest.mark.parametrize("order", [("test_adv_double", "test_adv_shift"), ("test_adv_shift", "test_adv_double")])
def test_advantage_chain_follows_configured_order(order):
    ChainRecorder.calls = []
    with temporary_plugin(DoubleAdv), temporary_plugin(ShiftAdv):
        trainer = make_tiny_trainer(plugins=list(order), reward_funcs=[digit_fraction_reward], log_level="error")
        out = _generate(trainer, _rows(trainer, 1))
    names = [name for name, _ in ChainRecorder.calls]
    assert names == (["double", "shift"] if order[0] == "test_adv_double" else ["shift", "double"])
    trl_advantages = ChainRecorder.calls[0][1]
    assert trl_advantages.abs().sum() > 0
    if order[0] == "test_adv_double":
        expected = trl_advantages * 2 + 1
    else:
        expected = (trl_advantages + 1) * 2
    # the second plugin sees the first one's output (a chain, not two views of TRL's advantages)
    first_output = trl_advantages * 2 if order[0] == "test_adv_double" else trl_advantages + 1
    torch.testing.assert_close(ChainRecorder.calls[1][1], first_output)
    torch.testing.assert_close(out["advantages"], expected)
    # the completions table shows the final advantages
    torch.testing.assert_close(torch.tensor(list(trainer._logs["advantages"])[-G:]), expected)


# ============================================================================================ (f) generation service


def _service_trainer(**config):
    trainer = make_tiny_trainer(reward_funcs=[digit_fraction_reward], log_level="error", **config)
    trainer.model.train()
    return trainer


def _echo_backend(calls):
    """Fake backend: the completion of a prompt is its last three ids (so results can be matched to requests)."""

    def fake(prompt_ids, images, multimodal_fields, num_generations, *args, **kwargs):
        calls.append(([list(p) for p in prompt_ids], num_generations))
        return [list(p[-3:]) for p in prompt_ids], [[-1.0, -2.0, -3.0] for _ in prompt_ids]

    return fake


def _other_process_requests(monkeypatch, trainer, n_other, used_other=0, other_failed=False):
    """Simulate a second process: accelerator.gather appends its request count, completions already used and
    whether it holds a reward error from sampling-stage scoring."""

    def gather(tensor):
        if tensor.numel() == CAUSE_BYTES + 1:  # after a set flag: the failing process's error, as bytes
            other = torch.zeros_like(tensor)
            if other_failed:
                text = b"ZeroDivisionError: judge divided by zero"
                other[0] = len(text)
                other[1 : len(text) + 1] = torch.tensor(list(text))
            return torch.cat([tensor, other])
        assert tensor.shape == (3,), "the service gathers (requested, used, scoring failed) per process"
        return torch.cat([tensor, torch.tensor([n_other, used_other, int(other_failed)], dtype=tensor.dtype)])

    monkeypatch.setattr(trainer.accelerator, "gather", gather)


def test_generation_service_pads_collectively_and_returns_local_results(monkeypatch):
    trainer = _service_trainer()
    service = trainer.generation_service
    calls = []
    monkeypatch.setattr(trainer, "_generate_single_turn", _echo_backend(calls))
    _other_process_requests(monkeypatch, trainer, 5)
    ds = trainer.train_dataset
    dummy = [7, 8, 9, 10]
    service.begin_batch(dummy)
    prompts = [ds[0]["prompt"], ds[1]["prompt"]]
    results = service.generate(prompts=prompts)
    real = [_tokenized(trainer, p) for p in prompts]
    assert len(calls) == 1
    sent, num_generations = calls[0]
    assert num_generations == 1
    assert len(sent) == 5  # the other process asked for 5: everyone issues 5
    assert sent[:2] == real and all(s == real[0] for s in sent[2:])  # padded with dummies
    assert [r.completion_ids for r in results] == [p[-3:] for p in real]  # only local results, in order
    assert results[0].text == trainer.processing_class.decode(real[0][-3:], skip_special_tokens=True)
    assert results[0].logprobs == [-1.0, -2.0, -3.0]
    # dummies are not counted; the total counts every process's real requests (2 here + 5 there)
    assert service.used_this_batch == 2 and service.total == 7

    # nothing to ask locally: still one call with 5 dummy prompts, no result, nothing counted here
    assert service.generate(prompt_ids=[]) == []
    assert calls[1][0] == [dummy] * 5
    assert service.used_this_batch == 2 and service.total == 12

    # nobody asks: no call at all
    _other_process_requests(monkeypatch, trainer, 0)
    assert service.generate(prompt_ids=[]) == []
    assert len(calls) == 2


@pytest.mark.parametrize("failed_here", [True, False])
def test_generation_service_raises_a_held_scoring_error_on_every_process_before_generating(failed_here, monkeypatch):
    """A reward error held during after_generation (ctx.score on several processes) travels in the service's count
    gather: the holder raises its own error, the other process a PluginError naming it; nothing is generated."""
    trainer = _service_trainer()
    service = trainer.generation_service
    calls = []
    monkeypatch.setattr(trainer, "_generate_single_turn", _echo_backend(calls))
    _other_process_requests(monkeypatch, trainer, 1, other_failed=not failed_here)
    service.begin_batch([1])
    held = trainer.held_reward_errors
    if failed_here:
        held.holding = True
        assert held.hold(ZeroDivisionError("reward divided by zero"))
    expected = ((ZeroDivisionError, "divided by zero") if failed_here else
                (PluginError, "process 1 failed with ZeroDivisionError: judge divided by zero"))
    with pytest.raises(expected[0], match=expected[1]):
        service.generate(prompt_ids=[[5, 6]])
    assert calls == [] and service.used_this_batch == 0


def test_generation_service_prefix_continuation(monkeypatch):
    trainer = _service_trainer(max_completion_length=6)
    service = trainer.generation_service
    calls = []
    monkeypatch.setattr(trainer, "_generate_single_turn", _echo_backend(calls))
    service.begin_batch([1])
    (short, long) = service.generate(prompt_ids=[[20, 21], [30, 31]], prefix_ids=[[40], [41, 42, 43, 44]])
    assert calls[0][0] == [[20, 21, 40], [30, 31, 41, 42, 43, 44]]  # generation continues after the prefix
    assert short.completion_ids == [40, 20, 21, 40]  # prefix + new ids (the echo backend's last three)
    assert math.isnan(short.logprobs[0]) and short.logprobs[1:] == [-1.0, -2.0, -3.0]
    assert long.completion_ids == [41, 42, 43, 44, 42, 43]  # cut to max_completion_length
    assert all(math.isnan(x) for x in long.logprobs[:4]) and long.logprobs[4:] == [-1.0, -2.0]
    with pytest.raises(PluginError, match="exactly one of"):
        service.generate(prompts=[trainer.train_dataset[0]["prompt"]], prompt_ids=[[1]])
    with pytest.raises(PluginError, match="1 prefixes for 2 prompts"):
        service.generate(prompt_ids=[[1], [2]], prefix_ids=[[3]])


def test_generation_service_budget(monkeypatch):
    trainer = _service_trainer(plugin_generation_budget=3)
    service = trainer.generation_service
    calls = []
    monkeypatch.setattr(trainer, "_generate_single_turn", _echo_backend(calls))
    service.begin_batch([1])
    assert service.remaining == 3
    assert len(service.generate(prompt_ids=[[5, 6], [7, 8]])) == 2
    assert service.remaining == 1
    with pytest.raises(GenerationBudgetExceeded, match="plugin_generation_budget is 3"):
        service.generate(prompt_ids=[[5, 6], [7, 8]])
    assert len(calls) == 1 and service.used_this_batch == 2  # refused before generating
    # another process going over budget makes every process refuse (no deadlock on a one-sided raise), also
    # when this process's own request fits: 2 used + 1 asked <= 3 here, 3 used + 1 asked > 3 there
    _other_process_requests(monkeypatch, trainer, 1, used_other=3)
    with pytest.raises(GenerationBudgetExceeded, match="requested 1 more completions on process 1, which already used 3"):
        service.generate(prompt_ids=[[5, 6]])
    assert len(calls) == 1
    _other_process_requests(monkeypatch, trainer, 1, used_other=2)  # both at 2 + 1: allowed everywhere
    assert len(service.generate(prompt_ids=[[5, 6]])) == 1
    assert service.used_this_batch == 3
    # the budget is per generation batch
    service.begin_batch([1])
    _other_process_requests(monkeypatch, trainer, 0)
    assert len(service.generate(prompt_ids=[[5, 6], [7, 8], [9, 9]])) == 3
    assert service.total == 2 + (1 + 1) + 3  # every process's real completions, refused requests not counted


class AsksForMore(Plugin):
    name = "test_asks_for_more"
    per_batch = 2

    @hookimpl
    def trl_plugins_after_generation(self, ctx):
        results = ctx.service.generate(prompts=ctx.prompts[: AsksForMore.per_batch])
        assert len(results) == AsksForMore.per_batch
        ctx.replace_row(0, results[0].completion_ids, offpolicy=False, logprobs=results[0].logprobs)


def test_generation_service_counts_rollouts_in_training():
    AsksForMore.per_batch = 2
    with temporary_plugin(AsksForMore):
        trainer = make_tiny_trainer(
            plugins=["test_asks_for_more"], reward_funcs=[digit_fraction_reward], log_level="error", max_steps=2,
        )
        logs = []
        trainer.add_callback(_LogRecorder(logs))
        trainer.train()
    assert trainer.generation_service.total == 4
    assert trainer.plugin_state_dict()["__framework__"]["generation_service"] == {"total": 4}
    step_logs = [log for log in logs if "loss" in log]
    assert [log["plugins/framework/extra_rollouts"] for log in step_logs] == [2.0, 2.0]


def test_generation_budget_exceeded_in_training():
    AsksForMore.per_batch = 3
    with temporary_plugin(AsksForMore):
        trainer = make_tiny_trainer(
            plugins=["test_asks_for_more"], reward_funcs=[digit_fraction_reward], log_level="error", max_steps=1,
            plugin_generation_budget=2,
        )
        with pytest.raises(GenerationBudgetExceeded, match="requested 3 more completions"):
            trainer.train()
    AsksForMore.per_batch = 2


# ============================================================================================ (g) stacking


class StackSampler(Plugin):
    name = "test_stack_sampler"
    fired: list = []

    @hookimpl
    def trl_plugins_configure(self, trainer, args):
        StackSampler.fired.append("configure")

    @hookimpl
    def trl_plugins_after_generation(self, ctx):
        StackSampler.fired.append("sampling")
        ctx.splice(0, 2, ctx.completion_ids[0][2:])  # the first row's tail becomes off-policy
        ctx.annotations[0]["spliced"] = True
        ctx.log_metric("fired", 1.0)

    @hookimpl
    def trl_plugins_on_step_end(self, trainer, step):
        StackSampler.fired.append(f"step_end:{step}")


class StackReward(Plugin):
    name = "test_stack_reward"

    @hookimpl
    def trl_plugins_transform_rewards(self, ctx):
        StackSampler.fired.append("reward")
        ctx.log_metric("fired", 2.0)


class StackAdvantage(Plugin):
    name = "test_stack_advantage"
    seen = {}

    @hookimpl
    def trl_plugins_transform_advantages(self, ctx):
        StackSampler.fired.append("advantage")
        StackAdvantage.seen = dict(
            offpolicy_fraction=ctx.offpolicy_fraction.clone(), annotations=list(ctx.annotations),
            rewards=ctx.rewards.clone(), rewards_per_func=ctx.rewards_per_func.clone(),
            lengths=ctx.completion_lengths.clone(), swapped=ctx.prompt_swapped.clone(),
        )
        ctx.log_metric("fired", 3.0)


class StackLoss(Plugin):
    name = "test_stack_loss"

    @hookimpl
    def trl_plugins_loss(self, ctx):
        StackSampler.fired.append("loss")
        ctx.log_metric("offpolicy_tokens", float(ctx.offpolicy_mask.sum()))


def test_plugins_on_different_stages_compose():
    StackSampler.fired = []
    names = ["test_stack_sampler", "test_stack_reward", "test_stack_advantage", "test_stack_loss"]
    with temporary_plugin(StackSampler), temporary_plugin(StackReward), temporary_plugin(StackAdvantage), temporary_plugin(StackLoss):
        trainer = make_tiny_trainer(plugins=names, reward_funcs=[digit_fraction_reward], log_level="error", max_steps=1)
        logs = []
        trainer.add_callback(_LogRecorder(logs))
        trainer.train()
    assert StackSampler.fired == ["configure", "sampling", "reward", "advantage", "loss", "step_end:1"]
    merged = {k: v for log in logs for k, v in log.items()}
    assert merged["plugins/test_stack_sampler/fired"] == 1.0
    assert merged["plugins/test_stack_reward/fired"] == 2.0
    assert merged["plugins/test_stack_advantage/fired"] == 3.0
    assert merged["plugins/test_stack_loss/offpolicy_tokens"] > 0
    assert 0 < merged["plugins/framework/offpolicy_token_fraction"] < 1
    seen = StackAdvantage.seen
    n0 = seen["lengths"][0]
    assert seen["offpolicy_fraction"][0] == pytest.approx((n0.item() - 2) / n0.item())
    assert (seen["offpolicy_fraction"][1:] == 0).all()
    assert seen["annotations"][0] == {"spliced": True} and seen["annotations"][1] == {}
    torch.testing.assert_close(seen["rewards"], seen["rewards_per_func"][:, 0])
    assert not seen["swapped"].any()
    # the annotation reaches TRL's completions table
    assert list(trainer._logs["extra"]["plugin_annotations"])[:2] == ["spliced=True", ""]


# ============================================================================================ checkpoints


class Counter(Plugin):
    """A plugin with resumable state (a counter)."""

    name = "test_counter"

    def __init__(self, options=None):
        super().__init__(options)
        self.count = 0

    @hookimpl
    def trl_plugins_state_dict(self):
        return {"count": self.count}

    @hookimpl
    def trl_plugins_load_state_dict(self, state):
        self.count = state["count"]


def test_missing_plugin_state_on_resume_warns_and_starts_fresh(tmp_path):
    """A checkpoint without the state file, or whose file lacks a plugin, says so (the plugin starts fresh)."""
    from trl_plugins.runtime.trainer import PLUGIN_STATE_FILE

    with temporary_plugin(Counter):
        trainer = make_tiny_trainer(plugins=["test_counter"], reward_funcs=[digit_fraction_reward], log_level="error")
        plugin = trainer.plugin_stack.by_name["test_counter"]
        with pytest.warns(UserWarning, match=r"has no trl_plugins_state.pt .*\['test_counter'\] starts fresh"):
            trainer._load_optimizer_and_scheduler(str(tmp_path))
        torch.save({"__framework__": {}, "other_plugin": {}}, tmp_path / PLUGIN_STATE_FILE)
        with pytest.warns(UserWarning, match=r"holds no state for plugins \['test_counter'\]"), pytest.warns(
            UserWarning, match=r"holds state for plugins \['other_plugin'\], which this run does not enable"
        ):
            trainer._load_optimizer_and_scheduler(str(tmp_path))
        torch.save({"__framework__": {}, "test_counter": {"count": 7}}, tmp_path / PLUGIN_STATE_FILE)
        trainer._load_optimizer_and_scheduler(str(tmp_path))
        assert plugin.count == 7


# ============================================================================================ (g) real services


class ServicesProbe(Plugin):
    """Records what the contexts' services give in a real run (tokenizer, run settings, mode, policy log-probs)."""

    name = "test_services_probe"
    seen = {}

    @hookimpl
    def trl_plugins_after_generation(self, ctx):
        ServicesProbe.seen = dict(
            tokenizer=ctx.tokenizer, run=ctx.run, mode=ctx.mode, device=ctx.device, prompt_ids=list(ctx.prompt_ids[0]),
            completion_ids=list(ctx.completion_ids[0]),
            logprobs=ctx.policy_logprobs([ctx.prompt_ids[0], ctx.prompt_ids[1]], [ctx.completion_ids[0], [5]]),
            padded=ctx.gather_padded(torch.tensor([[1, 2]]), dim=1, pad_value=-1),
        )

    @hookimpl
    def trl_plugins_transform_advantages(self, ctx):
        ServicesProbe.seen["advantage_mode"] = ctx.mode
        ServicesProbe.seen["reward_func_names"] = ctx.run.reward_func_names


def test_contexts_get_the_trainers_services():
    with temporary_plugin(ServicesProbe):
        trainer = make_tiny_trainer(plugins=["test_services_probe"], reward_funcs=[digit_fraction_reward],
                                    log_level="error", max_completion_length=8)
        trainer._generate_single_turn = _fake_single_turn()
        _generate(trainer, _rows(trainer, 1))
    seen = ServicesProbe.seen
    assert seen["tokenizer"] is trainer.processing_class and seen["mode"] == seen["advantage_mode"] == "train"
    assert seen["run"].max_completion_length == 8 and seen["run"].num_processes == 1
    assert seen["device"] == trainer.accelerator.device
    assert seen["reward_func_names"] == ("digit_fraction_reward",)
    assert seen["padded"].tolist() == [[1, 2]]  # one process: nothing to pad
    # ctx.policy_logprobs == a plain forward of the row (temperature-scaled log-softmax at the completion tokens)
    p, c = seen["prompt_ids"], seen["completion_ids"]
    with torch.no_grad():
        logits = trainer.model(torch.tensor([p + c])).logits[0, len(p) - 1: len(p) + len(c) - 1].float()
    expected = torch.log_softmax(logits / trainer.temperature, -1).gather(1, torch.tensor(c)[:, None])[:, 0]
    got, short = seen["logprobs"]
    assert got.shape == (len(c),) and short.shape == (1,)
    torch.testing.assert_close(got.float(), expected, atol=1e-4, rtol=1e-4)

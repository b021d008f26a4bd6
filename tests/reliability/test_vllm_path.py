"""The vLLM generation path, with TRL's vLLM backend replaced at its client boundary.

``trainer.vllm_generation`` is swapped for :class:`FakeServerVLLM`, which behaves like TRL 1.16's
``VLLMGeneration.generate`` in **server** mode (``trl/generation/vllm_generation.py``): it gathers the prompts of all
processes, keeps one prompt per group (``all_prompts[::num_generations]``), generates ``n = num_generations``
completions for each, and returns this process's slice as ``(prompt_ids, completion_ids, logprobs,
logprob_token_ids)`` with top-k log-prob lists (TRL keeps ``lp[0]``). Everything above that boundary -- TRL's
``_generate_single_turn`` (weight sync, log-prob extraction), the framework's per-row generation switch, the generation
service, provenance and TRL's importance-sampling correction -- is the real code.
"""

from __future__ import annotations

import hashlib
import math

import pytest
import torch
from accelerate.utils import gather_object

from trl_plugins import Plugin, hookimpl
from trl_plugins.api.contexts import OFFPOLICY_KEY
from trl_plugins.tasks.arithmetic import accuracy_reward
from trl_plugins.testing import digit_fraction_reward, make_tiny_trainer, temporary_plugin

G = 4


class FakeServerVLLM:
    """Server-mode ``VLLMGeneration`` stand-in (see the module docstring). Completion ``k`` of a unique prompt is a
    digit tag of the prompt (so tests can tell which prompt a completion came from), then ``k`` (even ``k``) or ``x``
    (odd ``k``: rewards vary within a group), then EOS; every token
    has log-prob ``-0.25 - 0.01 * k``; ``none_at`` puts a ``None`` log-prob (what vLLM reports for NaN) at that
    position."""

    def __init__(self, trainer, none_at: int | None = None):
        self.trainer = trainer
        self.calls: list[tuple[list[list[int]], int]] = []
        self.syncs = 0
        self.none_at = none_at
        tok = trainer.processing_class
        self.eos = tok.eos_token_id
        self.digit_ids = [tok.convert_tokens_to_ids(str(d)) for d in range(10)]
        self.x_id = tok.convert_tokens_to_ids("x")

    def tag(self, prompt_ids) -> list[int]:
        digest = hashlib.sha256(str(list(prompt_ids)).encode()).hexdigest()
        return [self.digit_ids[int(c, 16) % 10] for c in digest[:4]]

    def sync_weights(self):
        self.syncs += 1

    def generate(self, prompts, images, num_generations, profiler=None):
        acc = self.trainer.accelerator
        self.calls.append(([list(p) for p in prompts], num_generations))
        all_prompts = gather_object(prompts)
        unique = all_prompts[::num_generations]  # what the server receives
        completions, logprobs = [], []
        for p in unique:
            for k in range(num_generations):
                ids = self.tag(p) + [self.digit_ids[k % 10] if k % 2 == 0 else self.x_id, self.eos]
                lps = [[-0.25 - 0.01 * k] for _ in ids]
                if self.none_at is not None and self.none_at < len(lps):
                    lps[self.none_at] = [None]
                completions.append(ids)
                logprobs.append(lps)
        all_prompt_ids = [list(p) for p in unique for _ in range(num_generations)]
        local = slice(acc.process_index * len(prompts), (acc.process_index + 1) * len(prompts))
        return all_prompt_ids[local], completions[local], logprobs[local], None


def _vllm_trainer(plugins, plugin_config=None, none_at=None, **config):
    config.setdefault("reward_funcs", [digit_fraction_reward])
    trainer = make_tiny_trainer(plugins=plugins, plugin_config=plugin_config or {}, log_level="error", **config)
    fake = FakeServerVLLM(trainer, none_at=none_at)
    trainer.use_vllm = True
    trainer.vllm_mode = "server"
    trainer.vllm_generation = fake
    trainer._last_loaded_step = -1
    trainer.vllm_importance_sampling_correction = True
    trainer.vllm_importance_sampling_mode = "token_truncate"
    return trainer, fake


def _rows(trainer, n_prompts):
    ds = trainer.train_dataset
    return [dict(ds[k]) for k in range(n_prompts) for _ in range(G)]


def _generate(trainer, rows):
    trainer.model.train()
    return trainer._generate_and_score_completions(rows)


def _with_content(prompt, content):
    return [dict(m) for m in prompt[:-1]] + [{**prompt[-1], "content": content}]


class PerRowPrompts(Plugin):
    """Every row of a group gets its own generation prompt (as scaffolds and hints do)."""

    name = "test_per_row_prompts"

    @hookimpl
    def trl_plugins_generation_prompts(self, ctx):
        for i, prompt in enumerate(ctx.prompts):
            variant = f"{prompt[-1]['content']} [variant {ctx.index_in_group[i]}]"
            ctx.generation_prompts[i] = _with_content(prompt, variant)


def test_rows_of_a_group_with_different_prompts_get_one_completion_each():
    with temporary_plugin(PerRowPrompts):
        trainer, fake = _vllm_trainer(["test_per_row_prompts"], per_device_train_batch_size=2 * G)
        rows = _rows(trainer, 2)
        out = _generate(trainer, rows)
    (sent, n), = fake.calls
    assert n == 1, "per-row prompts must be generated one completion per prompt (no de-duplication)"
    assert len(sent) == 2 * G and len({tuple(p) for p in sent}) == 2 * G
    # every row's completion comes from its own generation prompt (the server saw all of them)
    mask = out["completion_mask"].bool()
    for i, prompt_ids in enumerate(sent):
        completion = out["completion_ids"][i][mask[i]].tolist()
        assert completion[:4] == fake.tag(prompt_ids), f"row {i} got another row's completion"
    # the training prompt stays the original one (generation prompt != training prompt: NaN sampling log-probs)
    assert torch.isnan(out["sampling_per_token_logps"][mask]).all()
    assert torch.equal(out["importance_sampling_ratio"][mask], torch.ones_like(out["importance_sampling_ratio"][mask]))


class Noop(Plugin):
    name = "test_noop_sampling"

    @hookimpl
    def trl_plugins_after_generation(self, ctx):
        pass


def test_unchanged_prompts_keep_the_grouped_server_call():
    with temporary_plugin(Noop):
        trainer, fake = _vllm_trainer(["test_noop_sampling"])
        out = _generate(trainer, _rows(trainer, 1))
    (sent, n), = fake.calls
    assert n == G and len(sent) == G  # TRL's own path: the server de-duplicates to one prompt, n = G
    mask = out["completion_mask"].bool()
    lps = out["sampling_per_token_logps"]
    for k in range(G):  # top-1 log-probs kept, row k = completion k of the group
        torch.testing.assert_close(lps[k][mask[k]], torch.full((int(mask[k].sum()),), -0.25 - 0.01 * k))


SPLICE_AT = 2


class Provenance(Plugin):
    """Row 1: off-policy splice; row 2: replaced on-policy from the generation service (through vLLM); row 3: a
    prefix continuation from the service."""

    name = "test_vllm_provenance"
    served = {}

    @hookimpl
    def trl_plugins_after_generation(self, ctx):
        ctx.splice(1, SPLICE_AT, [ctx.completion_ids[1][0]] * 3 + [ctx.tokenizer.eos_token_id])
        fresh, cont = ctx.service.generate(prompt_ids=[ctx.prompt_ids[2], ctx.prompt_ids[3]],
                                           prefix_ids=[[], ctx.completion_ids[3][:1]])
        Provenance.served = {"fresh": fresh, "cont": cont}
        ctx.replace_row(2, fresh.completion_ids, logprobs=fresh.logprobs)
        ctx.replace_row(3, cont.completion_ids, logprobs=cont.logprobs)


def test_offpolicy_tokens_carry_nan_sampling_logprobs_and_no_is_correction():
    with temporary_plugin(Provenance):
        trainer, fake = _vllm_trainer(["test_vllm_provenance"], none_at=0)
        out = _generate(trainer, _rows(trainer, 1))
    assert [n for _, n in fake.calls] == [G, 1]  # the group, then the service request (one completion per prompt)
    assert len(fake.calls[1][0]) == 2
    lps, mask, ratio = out["sampling_per_token_logps"], out["completion_mask"].bool(), out["importance_sampling_ratio"]
    off = out[OFFPOLICY_KEY]
    n1 = int(mask[1].sum())
    # row 1: kept prefix keeps its log-probs (position 0 was None from vLLM: NaN), spliced tokens are NaN + off-policy
    assert math.isnan(lps[1, 0]) and lps[1, 1].item() == pytest.approx(-0.26)
    assert torch.isnan(lps[1, SPLICE_AT:n1]).all() and off[1, SPLICE_AT:n1].all() and not off[1, :SPLICE_AT].any()
    # row 2: an on-policy replacement from the service keeps the server's log-probs (None -> NaN)
    fresh = Provenance.served["fresh"]
    assert math.isnan(fresh.logprobs[0]) and math.isnan(lps[2, 0])
    torch.testing.assert_close(lps[2, 1 : len(fresh.logprobs)], torch.tensor(fresh.logprobs[1:]))
    # row 3: the continuation's prefix token has NaN, its new tokens the server's
    assert math.isnan(lps[3, 0]) and not torch.isnan(lps[3, 2 : int(mask[3].sum())]).any()
    # TRL's IS correction leaves every NaN position alone (ratio exactly 1), and is live elsewhere
    nan = torch.isnan(lps) & mask
    assert torch.equal(ratio[nan], torch.ones_like(ratio[nan]))
    assert (ratio[mask & ~nan] != 1).any()
    assert not off[[0, 2, 3]].any()


@pytest.mark.slow
def test_training_through_the_vllm_path_syncs_weights_once_per_step():
    """Two steps of hint_scaffold (in-step generation through vLLM) + lp_reg, TRL's IS correction on."""
    # success is decided on the verifier (accuracy_reward); the fake server answers every hinted prompt alike, so
    # GHPO's default (keep the last hinted group) would leave zero advantages: keep the sampled group instead
    trainer, fake = _vllm_trainer(
        ["hint_scaffold", "lp_reg"],
        {"hint_scaffold": {"success_threshold": 0.5, "on_no_success": "original"}, "lp_reg": {"kappa": 0.45, "rho": 0.5}},
        max_steps=2, loss_type="dr_grpo", reward_funcs=[accuracy_reward, digit_fraction_reward],
    )
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    assert fake.syncs == 2, "weights are pushed once per optimizer step, not once per generation call"
    assert len(fake.calls) > 2 and any(n == 1 for _, n in fake.calls)  # hint requests went through the service
    logs = {k: v for log in trainer.state.log_history for k, v in log.items()}
    assert logs["plugins/framework/extra_rollouts"] > 0 and "sampling/importance_sampling_ratio/mean" in logs
    assert any(not torch.equal(before[n], p) for n, p in trainer.model.named_parameters())

"""REX-RAG: probe rollouts (failed trajectory cut before its answer + probe phrase, continued) and the mixture-policy
importance-sampling correction."""

import functools
import math
import re
from types import SimpleNamespace

import pytest
import torch

from trl_plugins import IncompatiblePluginsError, PluginConfigError, build_plugins
from trl_plugins.api.loss_types import CLIPPED_LOSS_TYPES
from trl_plugins.testing import assert_reduces_to_vanilla, digit_fraction_reward, make_advantage_context, \
    make_loss_context, make_tiny_trainer, record_run
from trl_plugins_builtin.rex_rag import PROBE_KEY, PROBE_Q_KEY, SCALE_EXTRA, SHIFT_EXTRA, RexRagPlugin, answer_cut, \
    corrected_surrogate, mixture_factors, mixture_logps, probe_token_probs


def test_probe_token_probs_are_the_pools_next_token_frequencies():
    pool = [[1, 2, 3], [1, 2, 4], [1, 5], [6]]
    # token 1: 3 of 4 phrases; then 2: 2 of the 3 starting with 1; then 3: 1 of the 2 starting with 1, 2
    assert probe_token_probs(pool, [1, 2, 3]) == [0.75, 2 / 3, 0.5]
    assert probe_token_probs(pool, [6]) == [0.25]
    assert probe_token_probs([[7, 8], [7, 9]], [7, 9]) == [1.0, 0.5]  # a shared first token has q = 1 (official)


def test_mixture_factors_by_hand():
    alpha, e = 0.25, 0.5
    scale, shift = mixture_factors(4, alpha, e, None)  # original row: (1 - alpha) pi_old
    assert scale.tolist() == [0.75] * 4 and shift.tolist() == [0.0] * 4
    # probe row: prefix of j = 2 tokens, probe of 1 token with q = 0.5, continuation of 2 tokens
    scale, shift = mixture_factors(5, alpha, e, (2, [0.5]))
    prefix = 0.75 + 0.25 / e ** 0.5  # pi_old / e^(1/j) on the prefix
    torch.testing.assert_close(scale, torch.tensor([prefix, prefix, 0.75, 1.0, 1.0]))
    torch.testing.assert_close(shift, torch.tensor([0.0, 0.0, 0.125, 0.0, 0.0]))
    scale, shift = mixture_factors(3, alpha, e, (0, [1.0, 0.5]))  # empty prefix: nothing divided by e
    torch.testing.assert_close(scale, torch.tensor([0.75, 0.75, 1.0]))
    torch.testing.assert_close(shift, torch.tensor([0.25, 0.125, 0.0]))


def test_is_correction_uses_the_mixture_in_the_clipped_ratio():
    old = torch.log(torch.tensor([[0.4, 0.1, 0.5]]))
    scale = torch.tensor([[0.75, 0.75, 1.0]])
    shift = torch.tensor([[0.0, 0.25, 0.0]])
    behaviour = mixture_logps(old, scale, shift)
    torch.testing.assert_close(behaviour.exp(), torch.tensor([[0.3, 0.325, 0.5]]))
    lp = torch.log(torch.tensor([[0.33, 0.13, 0.5]])).requires_grad_(True)
    A = torch.tensor([[1.0], ])
    loss = corrected_surrogate(lp, behaviour, A, 0.8, 1.2)
    r = torch.tensor([0.33 / 0.3, 0.13 / 0.325, 1.0])
    torch.testing.assert_close(loss.detach(), -torch.minimum(r, r.clamp(0.8, 1.2)).view(1, 3))
    loss.sum().backward()  # r = 1.1 and 1.0 inside the range: gradient -r; r = 0.4 below it with A > 0: still -r
    torch.testing.assert_close(lp.grad, -r.view(1, 3))
    # no probe in the batch: scale 1, shift 0 gives TRL's surrogate exactly
    same = mixture_logps(old, torch.ones(1, 3), torch.zeros(1, 3))
    torch.testing.assert_close(same, old)
    lp2 = torch.log(torch.tensor([[0.6, 0.1, 0.45]]))
    trl = -torch.minimum((lp2 - old).exp() * -2.0, (lp2 - old).exp().clamp(0.8, 1.2) * -2.0)
    torch.testing.assert_close(corrected_surrogate(lp2, same, torch.tensor([[-2.0]]), 0.8, 1.2), trl)


def test_answer_cut_ends_before_the_answer():
    decode = lambda ids: "".join(chr(i) for i in ids)  # noqa: E731  one character per token
    ids = [ord(c) for c in "so x=3 <answer>4</answer> done"]
    pattern = re.compile(r"<answer>.*?</answer>", re.DOTALL)
    assert decode(ids[:answer_cut(ids, decode, pattern)]) == "so x=3 "
    assert answer_cut([ord(c) for c in "no answer here"], decode, pattern) is None
    vocab = {1: "ab", 2: "cd <ans", 3: "wer>4</answer>"}  # the answer starts inside token 2
    assert answer_cut([1, 2, 3], lambda ids: "".join(vocab[i] for i in ids), pattern) == 1


def test_advantage_stage_attaches_the_mixture_of_the_whole_batch():
    plugin = RexRagPlugin()
    # G = 4: rows 0-2 sampled (row 0 succeeds), row 3 a probe of row 1 (prefix 1 token, probe 2 tokens)
    notes = [{}, {}, {}, {PROBE_KEY: {"start": 1, "length": 2, "source": 1, "phrase": 0}, PROBE_Q_KEY: [1.0, 0.5]}]
    ctx = make_advantage_context(torch.tensor([1.0, 0.0, 0.0, 0.0]), num_generations=4, annotations=notes,
                                 completion_lengths=[5, 5, 5, 5])
    plugin.trl_plugins_transform_advantages(ctx)
    scale, shift = ctx.local_extras[SCALE_EXTRA], ctx.local_extras[SHIFT_EXTRA]
    alpha, e = 0.25, 2 / 3  # one probe row in four; two of the three original rows fail
    T = scale.size(1)
    assert torch.allclose(scale[0], torch.full((T,), 1 - alpha))
    expect = torch.tensor([1 - alpha + alpha / e, 1 - alpha, 1 - alpha] + [1.0] * (T - 3))
    torch.testing.assert_close(scale[3], expect)
    torch.testing.assert_close(shift[3, :3], torch.tensor([0.0, alpha * 1.0, alpha * 0.5]))
    assert [v for k, v in ctx.metrics.items() if k.endswith("mixture_alpha")] == [[alpha]]


def test_loss_replaces_the_surrogate_only_when_the_batch_holds_probes():
    plugin = RexRagPlugin()
    old = torch.log(torch.tensor([[0.5, 0.5], [0.2, 0.4]]))
    lp = torch.log(torch.tensor([[0.5, 0.55], [0.3, 0.4]]))
    neutral = {SCALE_EXTRA: torch.ones(2, 2), SHIFT_EXTRA: torch.zeros(2, 2)}
    ctx = make_loss_context(lp, old_per_token_logps=old, advantages=torch.tensor([[1.0], [1.0]]), extras=neutral)
    plugin.trl_plugins_loss(ctx)
    assert ctx.replacement is None
    extras = {SCALE_EXTRA: torch.tensor([[0.75, 0.75], [1.0, 0.75]]), SHIFT_EXTRA: torch.tensor([[0, 0], [0, 0.25]])}
    ctx = make_loss_context(lp, old_per_token_logps=old, advantages=torch.tensor([[1.0], [1.0]]), extras=extras)
    plugin.trl_plugins_loss(ctx)
    mask, values = ctx.replacement
    assert bool(mask.all())
    r = torch.tensor([[0.5 / 0.375, 0.55 / 0.375], [1.5, 0.4 / 0.55]])
    torch.testing.assert_close(values, -torch.minimum(r, r.clamp(0.8, 1.2)))


def test_neutral_setting_switches_every_hook_off_and_is_vanilla():
    stack = build_plugins(["rex_rag"], {"rex_rag": {"probe_slots": 0}})
    for hook in ("trl_plugins_generation_prompts", "trl_plugins_after_generation", "trl_plugins_transform_advantages",
                 "trl_plugins_loss"):
        assert not stack.has(hook), hook
    assert_reduces_to_vanilla("rex_rag", {"probe_slots": 0}, loss_types=("grpo",))


def test_bad_options_and_settings_are_refused():
    for key, bad in (("probe_slots", -1), ("probe_prob", 1.5), ("probes", []), ("probes", ["ok", " "]),
                     ("answer_pattern", "("), ("answer_pattern", "a*")):
        with pytest.raises(PluginConfigError, match=key):
            build_plugins(["rex_rag"], {"rex_rag": {key: bad}})
    plugin = RexRagPlugin()
    args = dict(num_generations=8, loss_type="dapo", importance_sampling_level="token", delta=None)
    with pytest.raises(PluginConfigError, match="allowed: 0 to 0"):
        plugin.trl_plugins_configure(None, SimpleNamespace(**{**args, "num_generations": 1}))
    with pytest.raises(IncompatiblePluginsError, match="use_vllm=True"):
        plugin.trl_plugins_configure(None, SimpleNamespace(**args, use_vllm=True))
    assert RexRagPlugin.supported_loss_types() == CLIPPED_LOSS_TYPES  # cispo, sapo, vespo: refused by the trainer
    for change, match in (({"importance_sampling_level": "sequence"}, "allowed: 'token'"),
                          ({"delta": 2.0}, "delta=2.0")):
        with pytest.raises(PluginConfigError, match=match):
            plugin.trl_plugins_configure(None, SimpleNamespace(**{**args, **change}))
    with pytest.warns(UserWarning, match="alpha reach 0.50"):
        RexRagPlugin(RexRagPlugin.Options(probe_slots=2)).trl_plugins_configure(
            None, SimpleNamespace(**{**args, "num_generations": 4}))
    RexRagPlugin(RexRagPlugin.Options(probe_slots=0)).trl_plugins_configure(None, SimpleNamespace(use_vllm=True))


def zero_reward(completions, **kwargs):
    return [0.0] * len(completions)


@pytest.mark.filterwarnings("ignore:rex_rag. probe_slots=1 of num_generations=4")
def test_one_step_on_the_tiny_model_continues_a_failed_rollout_after_a_probe(tmp_path, monkeypatch):
    seen = []
    original = RexRagPlugin.trl_plugins_after_generation

    @functools.wraps(original)  # keeps the hookimpl marker
    def spy(self, ctx):
        before = [list(c) for c in ctx.completion_ids]
        original(self, ctx)
        seen.append((before, [list(c) for c in ctx.completion_ids], [dict(a) for a in ctx.annotations],
                     [list(f) for f in ctx.offpolicy]))

    monkeypatch.setattr(RexRagPlugin, "trl_plugins_after_generation", spy)
    # every rollout fails (the verifier column is 0) and every one is a candidate; the answer is the first digit
    config = {"probe_prob": 1.0, "answer_pattern": r"[0-9]", "probes": ["ab", "ac", "b"], "probe_prefix": ""}
    trainer = make_tiny_trainer(reward_funcs=[zero_reward, digit_fraction_reward], max_steps=1, plugins=["rex_rag"],
                                plugin_config={"rex_rag": config}, output_dir=str(tmp_path), loss_type="dapo",
                                max_completion_length=16)
    pool = RexRagPlugin(RexRagPlugin.Options(**config))._tokenize_pool(trainer.processing_class)
    run = record_run(trainer)
    before, after, notes, flags = seen[0]
    probes = [k for k, n in enumerate(notes) if PROBE_KEY in n]
    assert probes  # every rollout fails and has a digit: the probe slot takes one of them
    for k in range(len(after)):
        if k % 4 == 3 and k not in probes:
            assert after[k] and not any(flags[k])  # a slot without candidate: an ordinary rollout
            continue
        if k % 4 != 3:
            assert after[k] == before[k] and not any(flags[k])  # sampled rows are untouched
    for k in probes:
        note = notes[k][PROBE_KEY]
        j, P, source = note["start"], note["length"], k - k % 4 + note["source"]
        assert after[k][:j] == before[source][:j]  # the failed rollout's prefix, cut before its first digit
        assert after[k][j:j + P] == pool[note["phrase"]]  # then the probe phrase
        assert flags[k] == [False] * j + [True] * P + [False] * (len(after[k]) - j - P)
        assert notes[k][PROBE_Q_KEY] == probe_token_probs(pool, pool[note["phrase"]])
    log = run.logs[0]
    assert log["plugins/rex_rag/probe_rollouts"] == len(probes)
    assert math.isclose(log["plugins/rex_rag/mixture_alpha"], len(probes) / len(after))
    if probes:
        assert "plugins/rex_rag/corrected_ratio_mean" in log

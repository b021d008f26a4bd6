"""HICRA: the token amplification A + alpha |A| on hand-made tensors, the planning-token detector (phrase matching on
decoded text mapped back to tokens, for a character, a byte-level BPE and a SentencePiece-style tokenizer), the mask
computed at the advantage stage and applied at the loss stage, alpha = 0 == trl.GRPOTrainer end to end, and a short
run with amplification."""

from types import SimpleNamespace

import pytest
import torch
from trl import GRPOTrainer

from trl_plugins import PluginConfigError, build_plugins
from trl_plugins.api.contexts import PolicyStats
from trl_plugins.testing import (
    assert_runs_equal,
    digit_fraction_reward,
    make_advantage_context,
    make_loss_context,
    make_tiny_trainer,
    record_run,
    tiny_tokenizer,
)
from trl_plugins_builtin.hicra import (
    DEFAULT_PHRASES,
    MASK_KEY,
    amplify_advantages,
    phrase_patterns,
    planning_mask,
    planning_mask_from_pieces,
    token_pieces,
)


# ------------------------------------------------------------------------------------------ amplification
def test_amplification_hand_computed():
    A = torch.tensor([[1.0, 1.0, -2.0, -2.0, 0.0], [0.5, -0.5, 0.5, -0.5, 3.0]])
    planning = torch.tensor([[True, False, True, False, True], [False, True, True, False, False]])
    out = amplify_advantages(A, planning, 0.2)
    # planning: A + 0.2 |A| -> 1.2 for A = 1, -1.6 for A = -2, 0 for 0, -0.4 for -0.5, 0.6 for 0.5
    torch.testing.assert_close(out, torch.tensor([[1.2, 1.0, -1.6, -2.0, 0.0], [0.5, -0.4, 0.6, -0.5, 3.0]]))


def test_alpha_zero_is_the_identity():
    g = torch.Generator().manual_seed(0)
    A = torch.randn(4, 9, generator=g)
    planning = torch.rand(4, 9, generator=g) > 0.5
    assert torch.equal(amplify_advantages(A, planning, 0.0), A)


def test_amplification_only_on_planning_tokens_and_never_flips_the_sign():
    g = torch.Generator().manual_seed(1)
    A = torch.randn(3, 7, generator=g)
    planning = torch.rand(3, 7, generator=g) > 0.5
    out = amplify_advantages(A, planning, 0.5)
    assert torch.equal(out[~planning], A[~planning])
    assert torch.all(torch.sign(out[planning]) == torch.sign(A[planning]))
    assert torch.all(out[planning] > A[planning])  # positives grow, negatives shrink in magnitude (A != 0 here)


# ------------------------------------------------------------------------------------------ detector
def _patterns(phrases=("wait", "let's", "check"), **kw):
    return phrase_patterns(list(phrases), kw.get("case_sensitive", False), kw.get("whole_words", True))


def test_phrase_match_maps_to_overlapping_tokens():
    pieces = ["Wa", "it", ",", " let", "'s", " che", "cking", " check", "ed", " ok", ""]
    # "Wait" spans tokens 0-1; "let's" tokens 3-4; "checking" / "checked" are not whole-word matches of "check"
    assert planning_mask_from_pieces(pieces, _patterns()) == [
        True, True, False, True, True, False, False, False, False, False, False
    ]
    loose = planning_mask_from_pieces(pieces, _patterns(whole_words=False))
    assert loose == [True, True, False, True, True, True, True, True, False, False, False]
    strict_case = planning_mask_from_pieces(pieces, _patterns(case_sensitive=True))
    assert strict_case[:2] == [False, False] and strict_case[3:5] == [True, True]


def test_curly_apostrophe_and_symbol_phrases():
    pieces = ["Let", "\u2019", "s", " go", ":", " 3", "+", "4", "=", "7"]
    assert planning_mask_from_pieces(pieces, _patterns(("let's",)))[:3] == [True, True, True]
    # a phrase of symbols has no word-boundary guard
    assert planning_mask_from_pieces(pieces, _patterns(("=",)))[8] is True


def _bpe(kind):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    texts = ["Let's first check the sum. Wait, however we need to verify: 3+4=7.",
             "Alternatively, let me think again about it."] * 20
    if kind == "bytelevel":
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<eos>"],
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    else:  # SentencePiece-style: "▁" marks spaces, dropped at the start of a decode
        tok = Tokenizer(models.BPE(unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.Metaspace()
        tok.decoder = decoders.Metaspace()
        trainer = trainers.BpeTrainer(vocab_size=150, special_tokens=["<eos>", "<unk>"])
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<eos>")


@pytest.mark.parametrize("kind", ["char", "bytelevel", "metaspace"])
def test_token_pieces_rebuild_the_decoded_text(kind):
    tok = tiny_tokenizer() if kind == "char" else _bpe(kind)
    text = "mm, let's first check: wait... Alternatively verify it."
    ids = tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]

    def batch_decode(lists):
        return tok.batch_decode(lists, skip_special_tokens=True)

    pieces = token_pieces(ids, batch_decode)
    assert len(pieces) == len(ids) and pieces[-1] == ""  # EOS decodes to nothing
    assert "".join(pieces) == tok.decode(ids, skip_special_tokens=True) == text
    if kind == "metaspace":
        assert any(p.startswith(" ") for p in pieces)  # spaces a single-token decode would drop are kept
    # every token overlapping "let's", "check", "wait" is flagged, nothing else
    flags = planning_mask_from_pieces(pieces, _patterns())
    spans = [(text.index(w), text.index(w) + len(w)) for w in ("let's", "check", "wait")]
    starts = [sum(len(p) for p in pieces[:k]) for k in range(len(pieces))]
    expected = [any(s < e and s + len(p) > b for b, e in spans) for s, p in zip(starts, pieces)]
    assert flags == expected and any(flags)


def test_planning_mask_on_padded_batch():
    tok = tiny_tokenizer()
    rows = ["Wait, 3+4=7", "so check it"]
    ids = [tok(r, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for r in rows]
    T = max(len(x) for x in ids) + 2
    batch = torch.tensor([x + [tok.pad_token_id] * (T - len(x)) for x in ids])
    mask = planning_mask(batch, lambda lists: tok.batch_decode(lists, skip_special_tokens=True), _patterns())
    assert mask.shape == batch.shape and mask.dtype == torch.bool
    assert mask[0].tolist() == [True] * 4 + [False] * (T - 4)  # "Wait" = 4 characters
    assert mask[1].tolist() == [False] * 3 + [True] * 5 + [False] * (T - 8)  # "check" at characters 3..7


def test_default_lexicon_and_option_validation():
    assert {"wait", "alternatively", "let's", "check"} <= set(DEFAULT_PHRASES)
    with pytest.raises(PluginConfigError, match="phrases"):
        build_plugins(["hicra"], {"hicra": {"phrases": []}})
    with pytest.raises(PluginConfigError, match="alpha"):
        build_plugins(["hicra"], {"hicra": {"alpha": -0.1}})


def test_configure_warns_about_double_focusing_with_top_entropy_quantile():
    stack = build_plugins(["hicra"])
    with pytest.warns(UserWarning, match="top_entropy_quantile"):
        stack.call("trl_plugins_configure", trainer=None, args=SimpleNamespace(top_entropy_quantile=0.2))


# ------------------------------------------------------------------------------------------ hooks
def _adv_ctx(completion_ids, with_ids=True):
    B = completion_ids.size(0)
    stats = PolicyStats(per_token_logps=None, entropies=None, mask=None, completion_ids=completion_ids,
                        mean_entropy=None)
    ctx = make_advantage_context(torch.zeros(B), num_generations=2, advantages=torch.zeros(B),
                                 completion_lengths=torch.ones(B), policy_stats=stats, tokenizer=tiny_tokenizer())
    if not with_ids:
        ctx.local_completion_ids = None  # as a trainer without them: the plugin must use the policy-stats forward
    return ctx


@pytest.mark.parametrize("with_ids", [True, False])
def test_mask_is_computed_at_the_advantage_stage_and_applied_at_the_loss(with_ids):
    tok = tiny_tokenizer()
    texts = ["ok wait", "check!!"]
    ids = torch.tensor([tok(t, add_special_tokens=False)["input_ids"] for t in texts])
    stack = build_plugins(["hicra"], {"hicra": {"alpha": 0.5, "phrases": ["wait", "check"]}})
    actx = _adv_ctx(ids, with_ids)  # without local ids the plugin falls back to the policy-stats forward
    stack.call("trl_plugins_transform_advantages", actx)
    planning = actx.local_extras[MASK_KEY]
    expected = torch.tensor([[False] * 3 + [True] * 4, [True] * 5 + [False] * 2])
    assert torch.equal(planning, expected)

    A = torch.tensor([[2.0] * 7, [-1.0] * 7])
    lctx = make_loss_context(torch.zeros(2, 7), advantages=A.clone(), mask=torch.tensor([[1] * 7, [1] * 6 + [0]]),
                             extras={MASK_KEY: planning}, loss_type="dapo", completion_ids=ids,
                             entropies=torch.zeros(2, 7))
    sink = lctx.metrics
    stack.call("trl_plugins_loss_advantages", lctx)
    torch.testing.assert_close(lctx.advantages, torch.where(expected, A + 0.5 * A.abs(), A))
    assert lctx.advantages[0, 3] == 3.0 and lctx.advantages[1, 0] == -0.5
    assert sink["plugins/hicra/planning_token_fraction"] == [pytest.approx(9 / 13)]


# ------------------------------------------------------------------------------------------ end to end
PHRASES = {"phrases": ["1", "2", "3", "="], "whole_words": False}  # the untrained model writes digits at random


def test_alpha_zero_is_vanilla_grpo(tmp_path):
    """alpha = 0 with a lexicon that does match: the run is trl.GRPOTrainer's, bit for bit."""
    common = dict(reward_funcs=[digit_fraction_reward], max_steps=2, output_dir=str(tmp_path))
    vanilla = record_run(make_tiny_trainer(GRPOTrainer, **common))
    plugin = record_run(make_tiny_trainer(plugins=["hicra"], plugin_config={"hicra": {"alpha": 0.0, **PHRASES}},
                                          **common))
    assert any(a.abs().max() > 0 for a in vanilla.advantages)
    assert_runs_equal(plugin, vanilla)
    fractions = [log["plugins/hicra/planning_token_fraction"] for log in plugin.logs if "loss" in log]
    assert len(fractions) == 2 and max(fractions) > 0  # planning tokens were found; alpha = 0 left them alone


def test_end_to_end_amplification_changes_the_update(tmp_path):
    common = dict(reward_funcs=[digit_fraction_reward], max_steps=1, output_dir=str(tmp_path))
    base = record_run(make_tiny_trainer(plugins=["hicra"], plugin_config={"hicra": {"alpha": 0.0, **PHRASES}},
                                        **common))
    trainer = make_tiny_trainer(plugins=["hicra"], plugin_config={"hicra": {"alpha": 1.0, **PHRASES}}, **common)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    run = record_run(trainer)
    assert torch.equal(run.completion_ids[0], base.completion_ids[0])  # same rollouts ...
    assert torch.equal(run.advantages[0], base.advantages[0])  # ... and sequence advantages ...
    assert any(not torch.equal(run.grads[0][k], base.grads[0][k]) for k in base.grads[0])  # ... other gradient
    assert any(not torch.equal(before[n], p) for n, p in run.params.items())
    logs = [log for log in run.logs if "loss" in log]
    assert len(logs) == 1 and logs[0]["plugins/hicra/planning_token_fraction"] > 0

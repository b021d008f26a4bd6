"""HICRA — Hierarchy-Aware Credit Assignment (arXiv:2509.03646, "Emergent Hierarchical Reasoning in LLMs
through Reinforcement Learning").

The paper finds that RL improves reasoning mostly through a small set of high-level *planning* tokens (strategic
phrases such as "let's first", "wait", "alternatively", "let me check") while the procedural tokens are learned
early. GRPO spreads the credit uniformly over every token; HICRA concentrates it on the planning tokens by
amplifying their token advantage::

    A_t = A + alpha * |A|    on planning tokens,     A_t = A elsewhere.

So on a positive response the planning tokens get ``(1 + alpha) A`` and on a negative one ``(1 - alpha) A`` (less
blame for the strategy). ``alpha = 0`` is vanilla GRPO.

Planning tokens: the paper identifies "strategic grams" (n-grams found by clustering and frequency over correct
solutions, or by an LLM tagger). This plugin uses a **lexicon** of strategic phrases (option ``phrases``; the
default below is ours): each phrase is matched, case-insensitively and on word boundaries, in the decoded text
of each completion, and every token whose text overlaps a match is a planning token. Token texts come from the
trainer's tokenizer: token ``k``'s text is ``decode([t_{k-1}, t_k])`` minus ``decode([t_{k-1}])`` (so
SentencePiece spaces and byte-level merges survive), or ``decode([t_k])`` when that is not a prefix; special
tokens (EOS, padding) decode to nothing and are never planning tokens.

Stages: the per-token planning mask is computed once per generation batch at the advantage stage (from this
process's completion ids, carried to the loss as a (B, T) per-row extra), and the amplification is a loss-stage
token-advantage transform, after which every later transform and the surrogate see the amplified advantages.

Reconstructed: the lexicon (the paper's strategic grams are data-derived), the default alpha = 0.2 (the value we
take from the paper's experiments; it is not stated as a default) and the token-overlap rule. The paper's
semantic-entropy analysis is a diagnostic, not part of the update, and is not implemented.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from trl_plugins.api import (
    AdvantageContext,
    LossContext,
    OfficialSource,
    Plugin,
    PluginConfigError,
    PluginOptions,
    hookimpl,
    option,
)

MASK_KEY = "hicra_planning_mask"

DEFAULT_PHRASES = [
    "let's", "let me", "first", "we need to", "the key", "the idea", "approach", "strategy", "plan",
    "however", "but wait", "wait", "hmm", "alternatively", "another way", "instead", "on second thought",
    "actually", "therefore", "thus", "so the answer", "in summary", "to summarize", "check", "verify",
    "double-check", "recall", "notice", "note that", "suppose", "assume",
]


@dataclass
class HicraOptions(PluginOptions):
    alpha: float = option(
        0.2, min=0.0, help="Amplification on planning tokens: A + alpha * |A| (0 = vanilla GRPO).", reconstructed=True
    )
    phrases: list[str] = option(
        default_factory=lambda: list(DEFAULT_PHRASES),
        help="Strategic-phrase lexicon; every token overlapping a match in the decoded completion is a planning token.",
        reconstructed=True,
    )
    case_sensitive: bool = option(False, help="Match the phrases case-sensitively.")
    whole_words: bool = option(
        True, help="A phrase starting/ending with a word character must not touch another word character there."
    )

    def validate(self) -> None:
        if not self.phrases or any(not p for p in self.phrases):
            raise PluginConfigError(
                f"Option 'phrases' of plugin 'hicra' got {self.phrases!r}; allowed: a non-empty list of non-empty strings."
            )


def phrase_patterns(phrases: Sequence[str], case_sensitive: bool, whole_words: bool) -> list[re.Pattern]:
    """One compiled regex per phrase (word-boundary guards only on the sides that are word characters)."""
    flags = 0 if case_sensitive else re.IGNORECASE
    patterns = []
    for phrase in phrases:
        body = re.escape(phrase.replace("\u2019", "'"))
        if whole_words and re.match(r"\w", phrase[0]):
            body = r"(?<!\w)" + body
        if whole_words and re.match(r"\w", phrase[-1]):
            body = body + r"(?!\w)"
        patterns.append(re.compile(body, flags))
    return patterns


def planning_mask_from_pieces(pieces: Sequence[str], patterns: Sequence[re.Pattern]) -> list[bool]:
    """Planning flag per token: True when the token's text overlaps a phrase match in the joined text.

    Args:
        pieces: the text of each token (``""`` for special tokens), in order.
    Returns:
        one bool per token.
    """
    text = "".join(pieces).replace("\u2019", "'")  # same length: offsets unchanged
    starts, pos = [], 0
    for piece in pieces:
        starts.append(pos)
        pos += len(piece)
    covered = bytearray(len(text))
    for pattern in patterns:
        for m in pattern.finditer(text):
            covered[m.start():m.end()] = b"\x01" * (m.end() - m.start())
    return [any(covered[s:s + len(p)]) for s, p in zip(starts, pieces)]


def token_pieces(ids: Sequence[int], batch_decode: Callable[[list[list[int]]], list[str]]) -> list[str]:
    """Text of each token in context: ``decode([t_{k-1}, t_k])`` minus ``decode([t_{k-1}])`` when that is a
    prefix, else ``decode([t_k])``. ``batch_decode`` decodes a list of id lists (special tokens skipped)."""
    ids = list(ids)
    if not ids:
        return []
    singles = batch_decode([[t] for t in ids])
    pairs = batch_decode([[ids[k - 1], ids[k]] for k in range(1, len(ids))])
    pieces = [singles[0]]
    for k in range(1, len(ids)):
        prev, pair = singles[k - 1], pairs[k - 1]
        pieces.append(pair[len(prev):] if pair.startswith(prev) else singles[k])
    return pieces


def planning_mask(
    completion_ids: torch.Tensor, batch_decode: Callable[[list[list[int]]], list[str]], patterns: Sequence[re.Pattern]
) -> torch.Tensor:
    """(B, T) bool planning mask of right-padded completion ids (B, T)."""
    rows = [planning_mask_from_pieces(token_pieces(r, batch_decode), patterns) for r in completion_ids.tolist()]
    return torch.tensor(rows, dtype=torch.bool, device=completion_ids.device).view(completion_ids.shape)


def amplify_advantages(advantages: torch.Tensor, planning: torch.Tensor, alpha: float) -> torch.Tensor:
    """HICRA token advantages: ``A + alpha |A|`` where ``planning`` (B, T) is True, ``A`` elsewhere. (B, T)."""
    return torch.where(planning, advantages + alpha * advantages.abs(), advantages)


class HicraPlugin(Plugin):
    """Amplifies the advantage on planning tokens found with a strategic-phrase lexicon."""

    name = "hicra"
    image_inputs = True
    multi_turn = True
    version = "0.1.0"
    paper = "Emergent Hierarchical Reasoning in LLMs through Reinforcement Learning (HICRA), arXiv:2509.03646"
    summary = "Concentrates credit on planning tokens (strategic-phrase lexicon): A + alpha |A| there."
    Options = HicraOptions
    official = OfficialSource(
        None, verdict="reconstructed",
        note="TIGER-AI-Lab/Hierarchical-Reasoner@964c429 holds no training code (its README: recipe to be released); "
        "checked against a third-party port, huggingface/trl@4915fb2 (trl/trainer/hicra_trainer.py); alpha and the "
        "strategic phrases are reconstructed.",
    )
    claim_metric = ("planning_token_fraction", "amplified (planning) tokens")
    reconstructed = (
        "planning tokens from a strategic-phrase lexicon (the paper derives strategic grams from data)",
        "alpha = 0.2 default (not stated in the spec)",
        "a token is a planning token when its decoded text overlaps a phrase match",
    )

    def __init__(self, options=None):
        super().__init__(options)
        o = self.options
        self._patterns = phrase_patterns(o.phrases, o.case_sensitive, o.whole_words)

    @hookimpl
    def trl_plugins_configure(self, trainer, args):
        if args.top_entropy_quantile < 1.0:
            warnings.warn(
                f"hicra: top_entropy_quantile={args.top_entropy_quantile} also focuses the update on a token subset "
                "(high-entropy tokens); together they focus twice (they stack, but check that this is what you want).",
                stacklevel=2,
            )

    @hookimpl
    def trl_plugins_transform_advantages(self, ctx: AdvantageContext):
        ids = ctx.local_completion_ids
        if ids is None:
            ids = ctx.policy_stats().completion_ids
        tokenizer = ctx.tokenizer

        def batch_decode(id_lists):
            return tokenizer.batch_decode(id_lists, skip_special_tokens=True)

        ctx.set_local_extra(MASK_KEY, planning_mask(ids, batch_decode, self._patterns))

    @hookimpl
    def trl_plugins_loss_advantages(self, ctx: LossContext):
        planning = ctx.extras[MASK_KEY].bool()
        ctx.advantages = amplify_advantages(ctx.advantages, planning, self.options.alpha)
        ctx.log_metric("planning_token_fraction", ctx.global_masked_mean(planning.float()))

"""PS-GRPO / Con-RAG — groups over a paraphrase set with group similarity rewards (arXiv:2510.04392).

Paraphrased Set GRPO trains a generator to give the same information for semantically equivalent queries: each
group's rollouts are spread over a **paraphrase set** of the query (the original and its paraphrases), and each
rollout is rewarded by its **similarity to the rollouts of the other paraphrases** (the group similarity reward, no
ground truth needed); because comparing every pair is costly, the reward can be estimated on a random subset of the
other rollouts (the paper's scalable approximation). Facts from the paper's abstract and public summaries: paraphrase
sets, several rollouts per paraphrase, the reward = similarity to the other paraphrases' outputs, the subsampled
estimate; no official code was found.

Here, for a row whose ``paraphrase_column`` holds ``m`` paraphrases, the group's G rows are spread over
``n = min(1 + m, max_paraphrases + 1, G)`` variants (row ``k`` of the group takes variant ``k mod n``; variant 0 is
the original prompt): each row is sampled from *and trained on* its variant (its last user message replaced; not a
prompt swap; the seam shared with ``ic_grpo``, :mod:`trl_plugins_builtin._paraphrase`). The reward column
``ps_grpo_similarity`` of rollout ``y`` of variant ``i`` is
``mean_{y' of variants != i} sim(y, y')`` over all such rollouts, or over ``num_compare`` of them drawn with a generator
seeded by ``(seed, step, row)`` (the approximation); ``sim`` is the token-level F1 of the two texts (``'f1'``) or the
exact match of their normalised answers (``'answer'``, with ``answer_extractor``). A group with one variant (no
paraphrase) gets 0. TRL's weighting adds it to the other rewards (e.g. the verifier's). With ``max_paraphrases = 0``
the plugin does nothing (vanilla GRPO). Besides the column, ``templates`` reword the question (``'{question}'`` stands
for it): variants after the column's paraphrases, for datasets without paraphrases.

Information-consistent GRPO (arXiv:2512.12858) builds its groups the same way but rewards entropy-based helpfulness
and stability; it is the separate plugin ``ic_grpo`` on the same paraphrase seam.

Reconstructed: the similarity (token F1; the paper reports lexical and semantic similarity measures), the round-robin
assignment of rows to variants, the subsample size and its seed, and paraphrases read from a dataset column (the
paper generates them with an LLM).
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from trl_plugins.api import OfficialSource, Plugin, PluginConfigError, RewardContext, hookimpl, option
from trl_plugins.api.answers import get_extractor, normalize_answer
from trl_plugins.api.success import placeholder_column

from ._paraphrase import ParaphraseGroups, ParaphraseOptions, variants_mean

COLUMN = "ps_grpo_similarity"


@dataclass
class PsGrpoOptions(ParaphraseOptions):
    num_compare: int | None = option(
        None, min=1,
        help="Rollouts of other variants each reward compares with (the paper's approximation); None = all of them.",
    )
    similarity: Literal["f1", "answer"] = option(
        "f1", help="'f1': token-level F1 of the two completions; 'answer': exact match of their extracted answers.",
        reconstructed=True,
    )
    answer_extractor: str = option("task", help="Answer extractor of similarity='answer' (see trl_plugins.api.answers).")
    reward_weight: float = option(1.0, help="TRL reward weight of the ps_grpo_similarity column.")

    def validate(self) -> None:
        self.check_templates("ps_grpo")
        try:
            get_extractor(self.answer_extractor)
        except ValueError as exc:
            raise PluginConfigError(f"Option 'answer_extractor' of plugin 'ps_grpo': {exc}") from exc


# ================================================================================================ formulas
def token_f1(a: str, b: str) -> float:
    """Token-level F1 of two texts (lower-cased whitespace tokens, multiset overlap); 1.0 for two empty texts."""
    ta, tb = a.lower().split(), b.lower().split()
    if not ta and not tb:
        return 1.0
    common = sum((Counter(ta) & Counter(tb)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(ta), common / len(tb)
    return 2 * precision * recall / (precision + recall)


def group_similarity(sim: torch.Tensor, variants: Sequence[int], compare: list[list[int]] | None = None) -> torch.Tensor:
    """(G,) group similarity rewards: rollout ``k``'s mean of ``sim[k, j]`` over the rollouts ``j`` of other variants
    (or over ``compare[k]``, a subset of them); 0 where there is none.

    Args:
        sim: (G, G) pairwise similarities of the group's rollouts. variants: (G,) variant of each rollout.
    """
    G = sim.size(0)
    out = torch.zeros(G, dtype=sim.dtype)
    for k in range(G):
        others = compare[k] if compare is not None else [j for j in range(G) if variants[j] != variants[k]]
        if others:
            out[k] = sim[k, others].mean()
    return out


def subsample(variants: Sequence[int], k: int, size: int | None, rng: random.Random) -> list[int]:
    """The rollouts of other variants rollout ``k`` is compared with: all, or ``size`` of them drawn by ``rng``."""
    others = [j for j in range(len(variants)) if variants[j] != variants[k]]
    return others if size is None or size >= len(others) else sorted(rng.sample(others, size))


# ================================================================================================ plugin
class PsGrpoPlugin(ParaphraseGroups, Plugin):
    """Each group spread over a paraphrase set, rewarded by agreement with the other paraphrases' rollouts."""

    name = "ps_grpo"
    multi_turn = "PS-GRPO compares single-turn answers across paraphrased queries."
    image_inputs = (
        "it rewrites the prompt's text into paraphrases, and image prompts carry that text as image and text parts."
    )
    version = "0.1.0"
    paper = (
        "Improving Consistency in Retrieval-Augmented Systems with Group Similarity Rewards (PS-GRPO, Con-RAG), "
        "arXiv:2510.04392"
    )
    summary = "Spreads each group over paraphrases of its query; rewards rollouts that agree with other paraphrases'."
    Options = PsGrpoOptions
    official = OfficialSource(
        None, verdict="reconstructed",
        note="No official code was found; from the paper's abstract and public summaries: the similarity measure, the "
        "assignment of rows to paraphrases and the subsampled estimate's size are reconstructed; paraphrases come "
        "from a dataset column.",
    )
    claim_metric = ("similarity_mean", "agreement across paraphrases")
    replaces = ("the generation and training prompts of the paraphrase rows",)
    reconstructed = (
        "similarity = token-level F1 of the completions (or exact match of extracted answers)",
        "row k of a group takes variant k mod n (variant 0 = the original prompt)",
        "num_compare rollouts drawn per reward with a generator seeded by (seed, step, group)",
        "paraphrases read from a dataset column or made by rewording templates (the paper generates them with an LLM)",
    )

    def __init__(self, options=None):
        super().__init__(options)
        self._seed = 0

    @hookimpl
    def trl_plugins_configure(self, trainer, args):
        self._seed = int(args.seed)
        self.check_paraphrase_column(trainer)

    @hookimpl
    def trl_plugins_reward_functions(self, args):
        return [placeholder_column(COLUMN, self.options.reward_weight)]

    def similarity(self, a: str, b: str) -> float:
        if self.options.similarity == "f1":
            return token_f1(a, b)
        extract = get_extractor(self.options.answer_extractor)
        x, y = extract(a), extract(b)
        return float(x is not None and y is not None and normalize_answer(x) == normalize_answer(y))

    @hookimpl
    def trl_plugins_transform_rewards(self, ctx: RewardContext):
        """Fill the similarity column from the gathered completions, one group at a time (every process alike)."""
        gathered = self.gathered_texts_and_variants(ctx)
        if gathered is None:
            return
        (texts, all_variants), G = gathered, ctx.num_generations
        values = torch.zeros(len(texts), dtype=torch.float64)
        for g in range(len(texts) // G):
            rows = range(g * G, (g + 1) * G)
            variants = all_variants[g * G:(g + 1) * G]
            sim = torch.tensor([[self.similarity(texts[a], texts[b]) for b in rows] for a in rows], dtype=torch.float64)
            rng = random.Random(hash((self._seed, ctx.step, g)) & 0xFFFFFFFF)
            compare = [subsample(variants, k, self.options.num_compare, rng) for k in range(G)]
            values[g * G:(g + 1) * G] = group_similarity(sim, variants, compare)
        rewards = ctx.rewards_per_func.clone()
        rewards[:, ctx.reward_func_names.index(COLUMN)] = values.to(rewards)
        ctx.rewards_per_func = rewards
        ctx.log_metric("similarity_mean", float(values.mean()) if len(values) else 0.0)
        ctx.log_metric("variants_mean", variants_mean(all_variants, G))

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
prompt swap). The reward column ``ps_grpo_similarity`` of rollout ``y`` of variant ``i`` is
``mean_{y' of variants != i} sim(y, y')`` over all such rollouts, or over ``num_compare`` of them drawn with a generator
seeded by ``(seed, step, row)`` (the approximation); ``sim`` is the token-level F1 of the two texts (``'f1'``) or the
exact match of their normalised answers (``'answer'``, with ``answer_extractor``). A group with one variant (no
paraphrase) gets 0. TRL's weighting adds it to the other rewards (e.g. the verifier's). With ``max_paraphrases = 0``
the plugin does nothing (vanilla GRPO). Besides the column, ``templates`` reword the question (``'{question}'`` stands
for it): variants after the column's paraphrases, for datasets without paraphrases.

Information-consistent GRPO (arXiv:2512.12858) builds its groups the same way but rewards entropy-based helpfulness
and stability; the papers share no code, so it is not a mode of this plugin.

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

from trl_plugins.api import (
    OfficialSource,
    Plugin,
    PluginConfigError,
    PromptContext,
    RewardContext,
    hookimpl,
    option,
)
from trl_plugins.api.answers import get_extractor, normalize_answer
from trl_plugins.api.data_checks import check_column_values
from trl_plugins.api.options import PluginOptions
from trl_plugins.api.success import placeholder_column
from trl_plugins.api.text import completion_text, last_user_text, with_last_user_text

COLUMN = "ps_grpo_similarity"


@dataclass
class PsGrpoOptions(PluginOptions):
    paraphrase_column: str | None = option(
        "paraphrases", help="Dataset column holding each row's list of paraphrases; None = the templates only.",
    )
    templates: list[str] = option(
        default_factory=list,
        help="Rewordings applied to the question ('{question}' stands for it), variants after the column's "
        "paraphrases; e.g. ['Please answer: {question}'].",
        reconstructed=True,
    )
    max_paraphrases: int = option(
        3, min=0, help="Paraphrases used per row (besides the original); 0 = no paraphrase groups (vanilla).",
        reconstructed=True,
    )
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
        bad = [t for t in self.templates if "{question}" not in t]
        if bad:
            raise PluginConfigError(
                f"Option 'templates' of plugin 'ps_grpo' got {bad[0]!r}; allowed: strings holding '{{question}}'."
            )
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


def variant_of(index_in_group: int, num_variants: int) -> int:
    """The variant (0 = original) row ``index_in_group`` of a group with ``num_variants`` variants is sampled from."""
    return index_in_group % num_variants


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
class PsGrpoPlugin(Plugin):
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

    def hook_enabled(self, hook: str) -> bool:
        return self.options.max_paraphrases > 0

    def required_columns(self) -> list[str]:
        o = self.options
        return [o.paraphrase_column] if o.max_paraphrases > 0 and o.paraphrase_column else []

    def paraphrases(self, row: dict, question: str) -> list[str]:
        """The row's variants after the original: its paraphrase column's, then the templates applied to it."""
        o = self.options
        listed = list(row.get(o.paraphrase_column) or []) if o.paraphrase_column else []
        return listed + [t.replace("{question}", question) for t in o.templates]

    def num_variants(self, row: dict, group_size: int) -> int:
        o = self.options
        available = (len(row.get(o.paraphrase_column) or []) if o.paraphrase_column else 0) + len(o.templates)
        return min(1 + available, o.max_paraphrases + 1, group_size)

    @hookimpl
    def trl_plugins_configure(self, trainer, args):
        self._seed = int(args.seed)
        if self.options.paraphrase_column is None:
            return
        check_column_values(
            self.name, getattr(trainer, "train_dataset", None), self.options.paraphrase_column,
            lambda v: isinstance(v, (list, tuple)) and all(isinstance(p, str) and p.strip() for p in v),
            "a list of non-empty paraphrase strings (possibly empty)",
        )

    @hookimpl
    def trl_plugins_reward_functions(self, args):
        return [placeholder_column(COLUMN, self.options.reward_weight)]

    @hookimpl
    def trl_plugins_generation_prompts(self, ctx: PromptContext):
        """Row ``k`` of each group is sampled from, and trained on, variant ``k mod n`` of its prompt."""
        for i, row in enumerate(ctx.rows):
            variant = variant_of(ctx.index_in_group[i], self.num_variants(row, ctx.num_generations))
            if variant:
                text = self.paraphrases(row, last_user_text(ctx.prompts[i]))[variant - 1]
                prompt = with_last_user_text(ctx.prompts[i], text)
                ctx.generation_prompts[i] = prompt
                ctx.training_prompts[i] = prompt
                ctx.annotations[i]["paraphrase"] = variant

    def similarity(self, a: str, b: str) -> float:
        if self.options.similarity == "f1":
            return token_f1(a, b)
        extract = get_extractor(self.options.answer_extractor)
        x, y = extract(a), extract(b)
        return float(x is not None and y is not None and normalize_answer(x) == normalize_answer(y))

    @hookimpl
    def trl_plugins_transform_rewards(self, ctx: RewardContext):
        """Fill the similarity column from the gathered completions, one group at a time (every process alike)."""
        if ctx.mode != "train":
            return  # evaluation prompts are not paraphrased: the column stays 0
        G = ctx.num_generations
        texts = ctx.gather_object([completion_text(c) for c in ctx.local_completions])
        counts = ctx.gather_object([self.num_variants(row, G) for row in ctx.local_rows])
        values = torch.zeros(len(texts), dtype=torch.float64)
        for g in range(len(texts) // G):
            rows = range(g * G, (g + 1) * G)
            variants = [variant_of(k, counts[g * G]) for k in range(G)]
            sim = torch.tensor([[self.similarity(texts[a], texts[b]) for b in rows] for a in rows], dtype=torch.float64)
            rng = random.Random(hash((self._seed, ctx.step, g)) & 0xFFFFFFFF)
            compare = [subsample(variants, k, self.options.num_compare, rng) for k in range(G)]
            values[g * G:(g + 1) * G] = group_similarity(sim, variants, compare)
        rewards = ctx.rewards_per_func.clone()
        rewards[:, ctx.reward_func_names.index(COLUMN)] = values.to(rewards)
        ctx.rewards_per_func = rewards
        ctx.log_metric("similarity_mean", float(values.mean()) if len(values) else 0.0)
        ctx.log_metric("variants_mean", sum(counts) / max(len(counts), 1))

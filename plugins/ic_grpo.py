"""Information-consistent GRPO — paraphrase groups with entropy-based helpfulness and stability rewards
(arXiv:2512.12858, "Information-Consistent Language Model Recommendations through Group Relative Policy Optimization").

The paper trains a model to deliver the same information whatever the phrasing of a request: each GRPO group is a
set of **semantically equivalent prompt variants** (each asked in a fresh conversation, the context reset), and the
rollouts are rewarded by **entropy-based helpfulness and stability rewards**, so that answers carrying information
and staying invariant across the phrasings are preferred. Facts from the paper's abstract and public summaries:
groups of prompt variants, context reset, an entropy-based helpfulness reward and an entropy-based stability reward,
GRPO otherwise unchanged. No official code was found and the formulas were not reachable: the two rewards below are
reconstructions of "entropy-based helpfulness and stability".

Groups: the paraphrase seam shared with ``ps_grpo`` (:mod:`trl_plugins_builtin._paraphrase`): row ``k`` of a group is
sampled from and trained on variant ``k mod n`` of its prompt (the original, the ``paraphrase_column``'s paraphrases,
then the ``templates``); a single-turn variant is a fresh conversation (the paper's context reset). With
``max_paraphrases = 0`` the plugin enables no hook (vanilla GRPO).

Rewards (reconstructed), over the **information units** ``U(y)`` of a completion ``y`` (``units='words'``: its
lower-cased words; ``'lines'``: its non-empty lines, list markers stripped, lower-cased), with ``H(c) = -sum_u p_u log
p_u`` the Shannon entropy (nats) of counts ``c`` normalised to ``p``:

* ``ic_grpo_helpfulness`` of ``y`` = ``H(counts of the units of y)``: the information content of the answer (0 for an
  empty answer; ``log m`` for ``m`` distinct units used once; repetitions lower it).
* ``ic_grpo_stability`` of rollout ``k`` of a group = ``H(n - 1[U(y_k)]) - H(n)``, where ``n_u`` is the number of the
  group's rollouts whose units include ``u``: the drop in the entropy of the group's pooled information that rollout
  ``k`` causes. A rollout repeating what the other phrasings' answers say makes the pooled distribution more
  concentrated (positive); one bringing information the others lack spreads it (negative); identical answers give 0.
  A group with one variant (no paraphrase) gets 0, as consistency across phrasings is then undefined.

TRL's weighting adds both columns (``helpfulness_weight``, ``stability_weight``) to the other reward functions'.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from trl_plugins.api import OfficialSource, Plugin, RewardContext, hookimpl, option
from trl_plugins.api.success import placeholder_column

from ._paraphrase import ParaphraseGroups, ParaphraseOptions, variants_mean

HELPFULNESS = "ic_grpo_helpfulness"
STABILITY = "ic_grpo_stability"

_WORD = re.compile(r"\w+")
_LIST_MARKER = re.compile(r"^\s*(?:[-*+\u2022]|\d+[.)])\s*")


@dataclass
class IcGrpoOptions(ParaphraseOptions):
    units: Literal["words", "lines"] = option(
        "words",
        help="Information units of a completion: its lower-cased words, or its non-empty lines (list markers "
        "stripped; one recommendation per line).",
        reconstructed=True,
    )
    helpfulness_weight: float = option(1.0, help="TRL reward weight of the ic_grpo_helpfulness column.")
    stability_weight: float = option(1.0, help="TRL reward weight of the ic_grpo_stability column.")

    def validate(self) -> None:
        self.check_templates("ic_grpo")


# ================================================================================================ formulas
def information_units(text: str, units: str) -> list[str]:
    """The information units of ``text``, in order, repeats kept: lower-cased words or normalised lines."""
    if units == "words":
        return _WORD.findall(text.lower())
    lines = (" ".join(_LIST_MARKER.sub("", line).lower().split()) for line in text.splitlines())
    return [line for line in lines if line]


def shannon_entropy(counts: torch.Tensor) -> torch.Tensor:
    """Entropy in nats of non-negative ``counts`` (K,) normalised to a distribution; 0 when they sum to 0."""
    counts = counts.to(torch.float64)
    total = counts.sum()
    if total <= 0:
        return torch.zeros((), dtype=torch.float64)
    p = counts[counts > 0] / total
    return -(p * p.log()).sum()


def helpfulness(units: Sequence[str]) -> float:
    """Entropy of the unit counts of one completion (its information content)."""
    return float(shannon_entropy(torch.tensor(list(Counter(units).values()), dtype=torch.float64)))


def group_stability(unit_sets: Sequence[set[str]]) -> torch.Tensor:
    """(G,) stability rewards ``H(n - 1[U_k]) - H(n)`` of a group, ``n_u = #{k : u in U_k}``.

    Args:
        unit_sets: (G,) the distinct units of each rollout of the group.
    """
    vocab = sorted(set().union(*unit_sets)) if unit_sets else []
    index = {u: i for i, u in enumerate(vocab)}
    member = torch.zeros(len(unit_sets), len(vocab), dtype=torch.float64)  # (G, K) 1[u in U_k]
    for k, units in enumerate(unit_sets):
        member[k, [index[u] for u in units]] = 1.0
    pooled = member.sum(0)  # (K,) n_u
    h_all = shannon_entropy(pooled)
    return torch.stack([shannon_entropy(pooled - member[k]) - h_all for k in range(len(unit_sets))]) \
        if unit_sets else torch.zeros(0, dtype=torch.float64)


# ================================================================================================ plugin
class IcGrpoPlugin(ParaphraseGroups, Plugin):
    """Each group spread over a paraphrase set, rewarded by the entropy-based helpfulness and stability of its rollouts."""

    name = "ic_grpo"
    multi_turn = "Information-consistent GRPO compares single-turn answers across paraphrased requests (context reset)."
    image_inputs = (
        "it rewrites the prompt's text into paraphrases, and image prompts carry that text as image and text parts."
    )
    version = "0.1.0"
    paper = (
        "Information-Consistent Language Model Recommendations through Group Relative Policy Optimization, "
        "arXiv:2512.12858"
    )
    summary = "Spreads each group over paraphrases of its request; rewards informative answers that stay invariant."
    Options = IcGrpoOptions
    official = OfficialSource(
        None, verdict="reconstructed",
        note="No official code was found and the paper's reward formulas were not reachable; from its abstract and "
        "public summaries: groups of prompt variants with context reset, entropy-based helpfulness and stability "
        "rewards. Both reward formulas, the information units and the paraphrase assignment are reconstructed.",
    )
    claim_metric = ("group_information_entropy", "spread of the information across the paraphrases' answers")
    replaces = ("the generation and training prompts of the paraphrase rows",)
    reconstructed = (
        "information units = lower-cased words (or normalised lines) of the completion",
        "helpfulness = Shannon entropy of the completion's unit counts",
        "stability = the drop in the entropy of the group's pooled units a rollout causes, H(n - 1[U_k]) - H(n); "
        "0 for a group without paraphrases",
        "row k of a group takes variant k mod n (variant 0 = the original prompt)",
        "paraphrases read from a dataset column or made by rewording templates (the paper generates them)",
    )

    @hookimpl
    def trl_plugins_configure(self, trainer, args):
        self.check_paraphrase_column(trainer)

    @hookimpl
    def trl_plugins_reward_functions(self, args):
        o = self.options
        return [placeholder_column(HELPFULNESS, o.helpfulness_weight), placeholder_column(STABILITY, o.stability_weight)]

    @hookimpl
    def trl_plugins_transform_rewards(self, ctx: RewardContext):
        """Fill both columns from the gathered completions, one group at a time (every process alike)."""
        gathered = self.gathered_texts_and_variants(ctx)
        if gathered is None:
            return
        (texts, variants), G = gathered, ctx.num_generations
        units = [information_units(t, self.options.units) for t in texts]
        helpful = torch.tensor([helpfulness(u) for u in units], dtype=torch.float64)
        stable = torch.zeros(len(texts), dtype=torch.float64)
        spread = []
        for g in range(len(texts) // G):
            rows = slice(g * G, (g + 1) * G)
            sets = [set(u) for u in units[rows]]
            pooled = Counter(u for s in sets for u in s)
            spread.append(float(shannon_entropy(torch.tensor(list(pooled.values()), dtype=torch.float64))))
            if len(set(variants[rows])) > 1:
                stable[rows] = group_stability(sets)
        rewards = ctx.rewards_per_func.clone()
        rewards[:, ctx.reward_func_names.index(HELPFULNESS)] = helpful.to(rewards)
        rewards[:, ctx.reward_func_names.index(STABILITY)] = stable.to(rewards)
        ctx.rewards_per_func = rewards
        ctx.log_metric("helpfulness_mean", float(helpful.mean()) if len(texts) else 0.0)
        ctx.log_metric("stability_mean", float(stable.mean()) if len(texts) else 0.0)
        ctx.log_metric("group_information_entropy", sum(spread) / max(len(spread), 1))
        ctx.log_metric("variants_mean", variants_mean(variants, G))

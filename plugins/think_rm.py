"""Think-RM -- pairwise RLHF with a long-reasoning generative reward model (arXiv:2505.16265).

A generative RM that thinks at length before it answers is asked to **compare two responses** to the same prompt;
instead of converting its verdicts to pointwise rewards, the policy is optimised from the **pairwise preferences**
directly. Facts from the official code (IlgeeHong/Think-RM@2976ace, ``PairwiseRLHF/``):

1. Pairs: every unordered pair ``(i, j), i < j`` of the group, judged once with response i as "A" and j as "B"
   (``verl/workers/reward_manager/batch_pref.py:57-127``: ``itertools.combinations``).
2. Verdict (``verl/utils/reward_score/call_gen_prm_{binary,multiclass}.py:49``, the last ``<answer>...</answer>``
   block): binary ``A`` / ``B``, or multiclass a signed strength ``-3..-1`` (A better) / ``1..3`` (B better). The
   pairwise difference is ``d_ij = r_i - r_j = -verdict`` and ``d_ji = -d_ij``, ``d_ii = 0``.
3. Advantage (``verl/trainer/ppo/core_algos.py:106-160``, ``compute_grpo_difference_advantage``)::

       A_i = (sum_j d_ij / G) / sqrt( sum_{j,l in group} d_jl^2 / (2 G (G - 1)) + 1e-6 )

   the mean pairwise difference of row i, normalised by the group's root-mean-square pairwise difference
   (``sqrt(mean_{j<l} d_jl^2 / 2)``) -- GRPO's centring and scaling, in pairwise form.
4. Judge sampling: one answer per pair (``n=1``), temperature 0.6, at most 2048 tokens.

Here the numerator ``sum_j d_ij / G`` is the reward column ``think_rm`` (a win-rate-like group score; TRL's weights
and logging apply) and, with ``advantage="pairwise"`` (official), the advantage stage replaces TRL's advantages with
``A_i`` above; ``advantage="trl"`` keeps TRL's group normalisation of the column instead (a variant, which lets the
column stack with other rewards). The judge is the shared component :mod:`trl_plugins.components.genrm` (an endpoint
such as ``vllm serve ilgee/Binary-Think-RM-8B``, a local model, or a task's scripted judge); its prompt is our wording
of the official one. ``position_swap=True`` also asks each pair with the responses exchanged and averages both orders
(a variant controlling position bias; the official code asks once).

Unparsable verdicts: the official scorers count them as a tie (0). Here they are counted and logged, above
``genrm_max_unparsable`` of the batch's pairs the step fails naming the judge, the pair and the text, and a pair
without a verdict is left out of its rows' means (``sum_j d_ij / G`` is taken as ``(G-1)/G`` times the mean over the
judged pairs; a row with no judged pair scores 0) -- never silently read as a tie.

Deviation: the official binary scorer returns ``-+1 / len(judge answer)`` (a magnitude that shrinks with the judge's
verbosity, ``call_gen_prm_binary.py:49-58``); the binary verdict here is ``-+1`` (the advantage is normalised per group
either way).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, Literal

import torch

from trl_plugins.api.reasons import without_images
from trl_plugins.api import (
    AdvantageContext,
    OfficialSource,
    Plugin,
    PluginConfigError,
    PluginError,
    RewardContext,
    hookimpl,
    option,
)
from trl_plugins.api.engines import trainer_device
from trl_plugins.api.collectives import gather_objects_together
from trl_plugins.api.success import placeholder_column
from trl_plugins.api.text import completion_text
from trl_plugins.components.genrm import GenRMOptions, GenRMTemplate, genrm_from_options
from trl_plugins.components.steps import question_text

COLUMN = "think_rm"
EPSILON = 1e-6

_JUDGE_INTRO = (
    "You are an impartial judge. Compare the two AI assistants' responses to the question below on helpfulness, "
    "correctness, coherence, depth, an appropriate amount of detail, and safety. Think the comparison through step "
    "by step before you decide. "
)
_SECTIONS = ("[Question]\n{question}\n[End of Question]\n\n[Response A]\n{response_a}\n[End of Response A]\n\n"
             "[Response B]\n{response_b}\n[End of Response B]")

#: Binary verdict: which response is better (our wording of the official NaiveReasoningBinaryPromptTemplate).
BINARY_TEMPLATE = GenRMTemplate(
    name="think_rm/binary",
    system=_JUDGE_INTRO + "End with <answer>A</answer> if response A is better, or <answer>B</answer> if response B "
    "is better.",
    user=_SECTIONS,
    verdict_regex=r"<answer>\s*([AB])\s*</answer>",
    labels={"A": -1.0, "B": 1.0},
)

#: Multiclass verdict: a signed preference strength (our wording of NaiveReasoningMulticlassPromptTemplate).
MULTICLASS_TEMPLATE = GenRMTemplate(
    name="think_rm/multiclass",
    system=_JUDGE_INTRO + "Then rate the preference as a whole number from -3 to 3 (never 0): -3, -2, -1 when "
    "response A is much better, better, slightly better; 1, 2, 3 when response B is slightly better, better, much "
    "better. End with the number inside <answer></answer>.",
    user=_SECTIONS,
    verdict_regex=r"<answer>\s*([-+]?[123])\s*</answer>",
    labels={**{f"-{s}": -float(s) for s in (1, 2, 3)}, **{str(s): float(s) for s in (1, 2, 3)},
            **{f"+{s}": float(s) for s in (1, 2, 3)}},
)


@dataclass
class ThinkRmOptions(GenRMOptions):
    plugin_name: ClassVar[str] = "think_rm"

    verdict: Literal["binary", "multiclass"] = option(
        "binary", help="binary: A or B (Binary Think-RM); multiclass: a signed strength -3..3 (Multiclass Think-RM).",
    )
    advantage: Literal["pairwise", "trl"] = option(
        "pairwise", help="pairwise: A_i = mean pairwise difference / the group's RMS pairwise difference (official; "
        "replaces TRL's advantages, so the run's other reward columns must have weight 0); trl: TRL's group "
        "normalisation of the think_rm column.",
    )
    position_swap: bool = option(
        False, help="Also judge each pair with the responses exchanged and average both orders (official: once).",
    )
    k: int = option(1, min=1, help="Sampled verdicts per pair, averaged (official: n=1).")
    reward_weight: float = option(1.0, min=0.0, help="TRL reward weight of the think_rm column (0: neutral with "
                                  "advantage='trl').")
    genrm_temperature: float = option(0.6, min=0.0, help="Sampling temperature of the judge (official 0.6).")
    genrm_max_tokens: int = option(2048, min=1, help="Longest judge answer in tokens (official 2048).")


def pair_matrix(pairs: list[tuple[int, int, float]], n: int) -> torch.Tensor:
    """(N, N) pairwise differences ``d_ij = pref(i over j)`` from ``(i, j, pref)`` triples: antisymmetric, 0 on the
    diagonal, NaN for pairs not judged (other groups, or no parsable verdict)."""
    d = torch.full((n, n), math.nan)
    d.fill_diagonal_(0.0)
    for i, j, value in pairs:
        d[i, j], d[j, i] = value, -value
    return d


def pairwise_rewards(d: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Think-RM's numerator and per-group scale from the pairwise differences.

    Args:
        d: (N, N) from :func:`pair_matrix`, groups of ``group_size`` contiguous rows.
    Returns:
        numer: (N,) ``sum_j d_ij / G``, taken as ``(G-1)/G`` times the mean over row i's judged pairs (0 when none);
        scale: (N // G,) ``sqrt(sum_{j,l} d_jl^2 / (2 G (G-1)) + 1e-6)`` over the judged pairs (the sum scaled up to
        all pairs when some are missing).
    """
    G = group_size
    n_groups = d.size(0) // G
    blocks = torch.stack([d[g * G:(g + 1) * G, g * G:(g + 1) * G] for g in range(n_groups)])  # (N/G, G, G)
    off = ~torch.eye(G, dtype=torch.bool).expand_as(blocks)
    judged = ~torch.isnan(blocks) & off
    counts = judged.sum(dim=2)  # (N/G, G)
    sums = torch.where(judged, blocks, torch.zeros_like(blocks)).sum(dim=2)
    numer = torch.where(counts > 0, sums / counts.clamp(min=1) * (G - 1) / G, torch.zeros_like(sums)).reshape(-1)
    squares = torch.where(judged, blocks ** 2, torch.zeros_like(blocks)).sum(dim=(1, 2))
    pairs = judged.sum(dim=(1, 2)).clamp(min=1)
    scale = torch.sqrt(squares / pairs / 2 + EPSILON)  # = sqrt(S2 / (2G(G-1)) + eps) when every pair is judged
    return numer, scale


def _local_pairs(grm, ctx: RewardContext, questions: list[str], texts: list[str], swap: bool) -> list[list]:
    """Per local row i: ``[(j, pref(i over j))]`` for the rows j > i of its group (each pair asked once)."""
    G, start = ctx.num_generations, ctx.process_slice.start or 0
    asks = [(start + b, j) for b in range(len(ctx.local_rows))
            for j in range(start + b + 1, ((start + b) // G + 1) * G)]
    out: list[list] = [[] for _ in ctx.local_rows]
    if asks:
        result = grm.compare([questions[i] for i, _ in asks], [texts[i] for i, _ in asks],
                             [texts[j] for _, j in asks], swap=swap)
        for (i, j), value in zip(asks, result.values):
            out[i - start].append((j, value))
    return out


def judge_group_pairs(grm, ctx: RewardContext, plugin: str, swap: bool) -> list[list]:
    """Every unordered pair ``(i, j), i < j`` of each group judged by the pairwise GenRM ``grm`` (``swap``: in both
    orders, averaged), each process asking its own rows' pairs: (N,) lists, row i's ``[(j, pref(i over j))]``
    (NaN: no parsable verdict). Collective: every process calls it; a judge failing on one stops all (``plugin``)."""
    questions = ctx.gather_object([question_text(p) for p in ctx.local_prompts])  # (N,)
    texts = ctx.gather_object([completion_text(c) for c in ctx.local_completions])
    return gather_objects_together(ctx, plugin, _local_pairs, grm, ctx, questions, texts, swap)


class ThinkRmPlugin(Plugin):
    """Pairwise generative-RM verdicts within each group turned into group rewards and advantages (Think-RM)."""

    name = "think_rm"
    version = "0.1.0"
    paper = "Think-RM: Enabling Long-Horizon Reasoning in Generative Reward Models, arXiv:2505.16265"
    summary = "Judges every pair of a group with a generative RM; advantages from the pairwise preferences."
    Options = ThinkRmOptions
    official = OfficialSource(
        "IlgeeHong/Think-RM", "2976ace", verdict="faithful",
        files=("PairwiseRLHF/verl/workers/reward_manager/batch_pref.py",
               "PairwiseRLHF/verl/trainer/ppo/core_algos.py",
               "PairwiseRLHF/verl/utils/reward_score/call_gen_prm_binary.py",
               "PairwiseRLHF/verl/utils/reward_score/call_gen_prm_multiclass.py"),
        note="Binary verdicts are -+1 (official: -+1 / len(judge answer)); unparsable pairs are left out of the means "
        "and counted, refused past genrm_max_unparsable (official: a tie); prompts in our words.",
        variants=("advantage", "position_swap", "k"),
    )
    claim_metric = ("pair_scale_mean", "RMS pairwise preference within groups")
    multi_turn = (
        "its judge compares two answer texts to one question; tool calls and tool results are not part of the "
        "compared responses."
    )
    image_inputs = without_images("its generative judge reads the prompt as text")
    replaces = ("the advantages (advantage='pairwise': Think-RM's pairwise-difference advantages)",)
    overwrites = ("advantages",)  # recomputed from the pairwise differences: runs first in the advantage chain
    reconstructed = ("the prompt wording (the official templates' structure and verdict tags, our words)",)

    def __init__(self, options=None):
        super().__init__(options)
        self.grm = None
        self._device = None
        self._scale: torch.Tensor | None = None

    def overwritten(self) -> tuple[str, ...]:
        return self.overwrites if self.options.advantage == "pairwise" else ()

    def hook_enabled(self, hook: str) -> bool:
        if hook == "trl_plugins_transform_advantages":
            return self.options.advantage == "pairwise"
        return super().hook_enabled(hook)

    @hookimpl
    def trl_plugins_reward_functions(self, args):
        return [placeholder_column(COLUMN, self.options.reward_weight)]

    @hookimpl
    def trl_plugins_configure(self, trainer, args):
        self._device = trainer_device(trainer)
        if self.options.advantage == "pairwise":
            names = list(getattr(trainer, "reward_func_names", []))
            weights = [float(w) for w in getattr(trainer, "reward_weights", [])]
            others = [f"{n} (weight {w:g})" for n, w in zip(names, weights) if n != COLUMN and w != 0]
            if others:
                raise PluginConfigError(
                    f"think_rm with advantage='pairwise' replaces TRL's advantages by the pairwise ones (official), so "
                    f"the run's other reward columns would be ignored: {', '.join(others)}. Give them weight 0 "
                    "(reward_weights) or set advantage='trl'.")
        if self.grm is None:
            self.grm = self._build()

    def _build(self):
        o = self.options
        template = BINARY_TEMPLATE if o.verdict == "binary" else MULTICLASS_TEMPLATE
        return genrm_from_options(o, template, k=o.k, aggregate="mean", device=self._device)

    @hookimpl
    def trl_plugins_transform_rewards(self, ctx: RewardContext):
        names = ctx.reward_func_names
        if COLUMN not in names:
            return
        if self.grm is None:
            self.grm = self._build()
        per_row = judge_group_pairs(self.grm, ctx, self.name, self.options.position_swap)
        triples = [(i, j, v) for i, row in enumerate(per_row) for j, v in row]
        d = pair_matrix([(i, j, v) for i, j, v in triples if not math.isnan(v)], len(per_row))
        numer, self._scale = pairwise_rewards(d, ctx.num_generations)
        if triples:
            ctx.log_metric("unparsable_fraction", sum(math.isnan(v) for _, _, v in triples) / len(triples))
        ctx.log_metric("pair_scale_mean", self._scale.mean().item())
        matrix = ctx.rewards_per_func.clone()
        matrix[:, names.index(COLUMN)] = numer.to(matrix)
        ctx.rewards_per_func = matrix

    @hookimpl
    def trl_plugins_transform_advantages(self, ctx: AdvantageContext):
        names = list(ctx.run.reward_func_names)
        if self.options.advantage != "pairwise" or COLUMN not in names:
            return
        G = ctx.num_generations
        if self._scale is None or self._scale.numel() * G != ctx.rewards.numel():
            raise PluginError(
                f"think_rm: no pairwise scale for the {ctx.rewards.numel() // G} groups of this batch (the reward stage "
                "did not run on it).")
        numer = ctx.rewards_per_func[:, names.index(COLUMN)]
        scale = self._scale.to(numer).repeat_interleave(G)
        ctx.advantages = (numer / scale).to(ctx.advantages.dtype)

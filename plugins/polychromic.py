"""Polychromic objective — set-level advantages that reward successful *and* diverse rollouts (arXiv:2509.25424).

Set RL scores a *set* of ``n`` rollouts drawn from the same state instead of one rollout, and the polychromic score
of a set couples its success with its diversity multiplicatively, so a set scores high only when it holds successful
rollouts that differ from each other:

1. Sets: from a group's ``G`` rollouts of one prompt (GRPO's group is the paper's ``N`` vines of the root state),
   ``num_sets`` (M) sets of ``set_size`` (n) distinct rollouts are drawn uniformly (each set without replacement,
   the sets independently); ``num_sets=None`` takes every one of the ``C(G, n)`` subsets instead (the exact
   expectation; our option).
2. Score: ``f(g) = mean_{i in g} R_i * d(g)`` with ``d(g) = (number of distinct rollouts in g) / n`` (the paper's
   "fraction of unique trajectories"; which rollouts count as equal is the task's choice, see ``diversity``).
3. Baseline: the Monte-Carlo set value of the state, ``V = mean over the M sets of f(g)``.
4. Advantage of rollout ``i``: the mean of ``f(g) - V`` over the sets ``g`` that contain it (every rollout of a set
   shares the set's advantage; a rollout in several sets takes the mean); a rollout in no set gets 0.
5. Scale: divided by ``std(f) + 1e-4`` the way TRL scales the reward advantage (``scale_rewards``: ``"group"`` the
   std of the group's M set scores, ``"batch"`` the std of every set score of the batch, ``"none"`` no division).

Diversity for text (``diversity``): the paper's tasks are grid worlds and an algorithmic-creativity task where two
trajectories are the same when they visit the same rooms / produce the same object. For LLM text the default is
**distinct final answers** (``"answers"``: the extracted answers compared by normalised exact match, the same
clustering as ``seed_grpo`` and ``empo``; reconstructed); ``"texts"`` compares whole completions (up to case and
whitespace); ``"off"`` sets ``d = 1`` (the set's mean reward alone). A completion without an extractable answer is
distinct from every other by default (``unanswered="singleton"``).

Neutral setting: ``set_size=1`` with ``num_sets=None`` (each rollout its own set: ``d = 1``, ``f = R``) gives
``A_i = (R_i - mean R) / (std R + 1e-4)``, TRL's advantage, bit for bit (tested). Defaults: ``n = 4``, ``M = 4``
(the paper's Table 3, with ``N = 8`` vines, which is GRPO's ``num_generations=8``).

Vine sampling (``rollout_states`` > 0; off by default, the paper uses 2): at ``rollout_states`` evenly spaced
intermediate states of a rollout (the prefix ``completion[:c]``), ``vines - 1`` continuations are sampled through the
branching seam (``ctx.continue_prefixes``, HF generation; counted in the rollout budget); with the rollout's own
continuation they are the state's ``N = vines`` trajectories. Sets are drawn among them as above, and each
trajectory's set advantage at that state (std-scaled within the state) replaces its advantage on the ``window``
completion tokens from ``c`` on (the paper's W = 5 actions, read as tokens); the other tokens keep the group-level
advantage (the paper: GAE elsewhere). Two ways (``vine_rows``):

* ``"trained"`` (default, the paper trains the vines): the group is grown as trees of ``L = 1 + rollout_states
  (vines - 1)`` rows, a root and its vines (as ``ettrl``'s trees): the vine rows (index in group ``k`` with ``k mod L
  != 0``) are deferred at the prompt stage (``PromptContext.defer``), TRL samples the roots, and the sampling stage
  fills each vine row with a continuation of its root's prefix (``replace_row``). Vines are rows of the group: they
  are rewarded, enter the group-level sets like every rollout, and take their state's set advantage on their window;
  ``L`` must fit in ``num_generations`` (a partial last tree takes its first rows);
* ``"scored"`` (the previous behaviour, a cheaper variant: G independent rollouts plus extra generations): every
  rollout keeps its row, the vines are extra generations scored by TRL's reward functions (``ctx.score``), and only
  the rollout's own window takes the state's set advantage.

Reconstructed: the states are evenly spaced (the paper picks "a subset of visited states"); a vine row's prefix
tokens (its root's) are trained with the vine's group-level advantage, as ``ettrl``'s branches. Vine sampling needs HF generation and text prompts (the branching seam's limits; image
prompts train with it off). The per-state KL penalty to the pre-trained policy is TRL's ``beta``. NaN rewards (no reward
function applied) count as 0 in the set scores and the row gets advantage 0.

No official code was found (a paper summary lists the code as "TBD"; searches by title, authors and method names
found only third-party course replications); the method follows the paper's text, read through its summaries and
those replications, and is marked reconstructed.
"""

from __future__ import annotations

import itertools
import math
import warnings
from dataclasses import dataclass
from typing import Literal

import torch

from trl_plugins.api import (
    AdvantageContext,
    IncompatiblePluginsError,
    OfficialSource,
    Plugin,
    PluginConfigError,
    PluginOptions,
    PromptContext,
    RewardContext,
    RolloutContext,
    hookimpl,
    option,
)
from trl_plugins.api.answers import batch_clusters, cluster_answers, get_extractor
from trl_plugins.api.collectives import gather_id_lists
from trl_plugins.api.reasons import VLLM_BRANCHING, samples_outside_hf_generate
from trl_plugins.api.text import completion_text

#: Annotation key: ``[[state, advantage], ...]`` of a rollout's vine states (sampling stage -> advantage stage).
VINES_KEY = "polychromic_vines"
#: Annotation key of a vine row (``vine_rows="trained"``): ``[root's index in group, state index, state c]``.
VINE_ROW_KEY = "polychromic_vine_row"

#: At most this many sets per group with ``num_sets=None`` (every subset).
MAX_EXHAUSTIVE_SETS = 10_000


@dataclass
class PolychromicOptions(PluginOptions):
    set_size: int = option(4, min=1, help="Rollouts per set, n (paper Table 3: 4); at most num_generations.")
    num_sets: int | None = option(
        4, min=2,
        help="Sets drawn per group, M (paper Table 3: 4; at least 2: one set is its own baseline, every advantage "
        "would be 0); None: every C(G, n) subset (the exact expectation, ours).",
    )
    diversity: Literal["answers", "texts", "off"] = option(
        "answers",
        help="Which rollouts count as the same in d(g): equal final answers (default for text), equal whole "
        "completions (up to case and whitespace), or off (d = 1).",
        reconstructed=True,
    )
    extractor: str = option(
        "task",
        help="Answer extractor of diversity='answers': task, boxed, last_number, boxed_or_last_number, or "
        "'package.module:function'.",
    )
    unanswered: Literal["singleton", "cluster"] = option(
        "singleton",
        help="With diversity='answers', a completion without an answer is distinct from all others (singleton) or "
        "equal to the other unanswered ones (cluster).",
        reconstructed=True,
    )
    seed: int = option(0, help="Seed of the set draws (with the step and the group: the same on every process).")
    rollout_states: int = option(
        0, min=0,
        help="Vine sampling: intermediate states per rollout where vines branch (paper Table 3: 2; 0 = off, our "
        "default: each state costs vines - 1 continuations per rollout).",
    )
    vines: int = option(
        8, min=2, help="Vine sampling: trajectories per rollout state, the rollout's own continuation included (paper: 8).",
    )
    window: int = option(
        5, min=1, help="Vine sampling: completion tokens after a rollout state that take its set advantage (paper: 5 "
        "actions).",
    )
    vine_rows: Literal["trained", "scored"] = option(
        "trained",
        help="Vine sampling: 'trained' = the vines are rows of the group (trees of 1 + rollout_states * (vines - 1) "
        "rows), trained with their set advantage, as the paper; 'scored' = extra generations that only set the "
        "advantage of the rollout's own window (cheaper variant).",
    )

    @property
    def tree_size(self) -> int:
        """L = 1 + rollout_states (vines - 1) rows per tree with trained vines (1 otherwise)."""
        if self.rollout_states and self.vine_rows == "trained":
            return 1 + self.rollout_states * (self.vines - 1)
        return 1

    def validate(self) -> None:
        try:
            get_extractor(self.extractor)
        except ValueError as exc:
            raise PluginConfigError(f"Option 'extractor' of plugin 'polychromic': {exc}.") from exc
        if self.rollout_states and self.set_size > self.vines:
            raise PluginConfigError(
                f"Option 'set_size' of plugin 'polychromic' got {self.set_size!r} with vines={self.vines!r}; allowed: "
                "set_size <= vines when rollout_states > 0."
            )


def whole_text(text: str) -> str:
    """The ``diversity='texts'`` key: the whole completion (clustering normalises case and whitespace)."""
    return text


def draw_sets(
    group_size: int, set_size: int, num_sets: int | None, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Index sets of one group.

    Returns:
        (M, n) long: ``num_sets`` rows of ``set_size`` distinct indices in ``[0, group_size)`` drawn uniformly with
        ``generator``, or, with ``num_sets=None``, all ``C(group_size, set_size)`` subsets in lexicographic order.
    """
    if num_sets is None:
        return torch.tensor(list(itertools.combinations(range(group_size), set_size)), dtype=torch.long)
    keys = torch.rand(num_sets, group_size, generator=generator)
    return keys.argsort(dim=1)[:, :set_size]


def set_diversity(keys: torch.Tensor) -> torch.Tensor:
    """``d(g)``: the fraction of distinct keys in each set. keys (..., n) long. Returns (...,) float."""
    n = keys.size(-1)
    ordered = keys.sort(dim=-1).values
    distinct = 1 + (ordered[..., 1:] != ordered[..., :-1]).sum(dim=-1)
    return distinct.float() / n


def set_advantages(
    rewards: torch.Tensor, keys: torch.Tensor, sets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Polychromic set scores and per-rollout advantages (before scaling) of a batch of groups.

    Args:
        rewards: (num_groups, G) rewards (no NaN).
        keys: (num_groups, G) long diversity keys (equal key = same rollout for d).
        sets: (num_groups, M, n) long indices into the group.
    Returns:
        advantages (num_groups, G): mean of ``f(g) - V`` over the sets holding the rollout (0 in none);
        scores (num_groups, M) ``f(g)``; diversity (num_groups, M) ``d(g)``.
    """
    num_groups, G = rewards.shape
    flat = sets.reshape(num_groups, -1)
    members_r = rewards.gather(1, flat).view(sets.shape)
    members_k = keys.gather(1, flat).view(sets.shape)
    diversity = set_diversity(members_k)
    scores = members_r.mean(dim=-1) * diversity
    baseline = torch.nanmean(scores, dim=1, keepdim=True)
    deviation = scores - baseline  # (num_groups, M)
    member = torch.zeros(num_groups, sets.size(1), G, dtype=rewards.dtype, device=rewards.device)
    member.scatter_(2, sets, 1.0)
    total = (member * deviation.unsqueeze(-1)).sum(dim=1)
    count = member.sum(dim=1)
    advantages = torch.where(count > 0, total / count.clamp(min=1), torch.zeros_like(total))
    return advantages, scores, diversity


def score_std(scores: torch.Tensor, scale_rewards: str) -> torch.Tensor | None:
    """Std of the set scores as TRL scales rewards: (num_groups, 1) for "group", (1, 1) for "batch", None for "none".

    Unbiased (Bessel), as TRL's ``nanstd``; NaN with a single score.
    """
    if scale_rewards == "none":
        return None
    x = scores if scale_rewards == "group" else scores.reshape(1, -1)
    mean = torch.nanmean(x, dim=1, keepdim=True)
    variance = torch.nanmean((x - mean) ** 2, dim=1, keepdim=True)
    count = torch.sum(~torch.isnan(x), dim=1, keepdim=True)
    correction = torch.where(count > 1, count / (count - 1), torch.full_like(variance, float("nan")))
    return torch.sqrt(variance * correction)


def polychromic_advantages(
    rewards: torch.Tensor, keys: torch.Tensor, group_size: int, set_size: int, num_sets: int | None,
    scale_rewards: str, seed: int = 0, step: int = 0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Polychromic advantages of a whole generation batch.

    Args:
        rewards: (N,) combined rewards, groups of ``group_size`` contiguous; NaN counts as 0 and gets advantage 0.
        keys: (N,) long diversity keys, compared within a group only.
        scale_rewards: TRL's ``scale_rewards`` ("group", "batch" or "none").
    Returns:
        advantages (N,) in the rewards' dtype, and batch statistics (mean set score, diversity, baseline).
    """
    G = group_size
    nan = torch.isnan(rewards)
    R = torch.nan_to_num(rewards, nan=0.0).view(-1, G)
    K = keys.view(-1, G).to(R.device)
    num_groups = R.size(0)
    sets = []
    for g in range(num_groups):
        generator = torch.Generator().manual_seed((seed * 1_000_003 + step) * 1_000_003 + g)
        sets.append(draw_sets(G, set_size, num_sets, generator))
    sets_t = torch.stack(sets).to(R.device)
    adv, scores, diversity = set_advantages(R, K, sets_t)
    std = score_std(scores, scale_rewards)
    if std is not None:  # a single set score (set_size = G with num_sets=None) has no spread: its advantages are 0
        adv = adv / (torch.nan_to_num(std, nan=0.0) + 1e-4)
    adv = adv.reshape(-1)
    adv = torch.where(nan, torch.zeros_like(adv), adv)
    covered = torch.zeros_like(R).scatter_(1, sets_t.reshape(num_groups, -1), 1.0)
    stats = {
        "set_score": float(scores.mean()),
        "set_diversity": float(diversity.mean()),
        "rollouts_in_no_set": float(1.0 - covered.mean()),
    }
    return adv, stats


def group_keys(cluster_ids: list[list[int | None]], unanswered: str) -> torch.Tensor:
    """(N,) long diversity keys from per-group cluster ids; unanswered rows get a key of their own ("singleton") or
    one shared key ("cluster")."""
    out = []
    for ids in cluster_ids:
        for j, c in enumerate(ids):
            if c is not None:
                out.append(c)
            else:
                out.append(-1 if unanswered == "cluster" else -(j + 2))
    return torch.tensor(out, dtype=torch.long)


def rollout_positions(length: int, count: int) -> list[int]:
    """Rollout states of a completion of ``length`` tokens: ``count`` evenly spaced cut positions
    ``floor(k length / (count + 1))``, ``k = 1..count``, kept in ``[1, length - 1]`` and distinct (reconstructed: the
    paper selects "a subset of visited states"). A state ``c`` is the prefix ``completion[:c]``."""
    return sorted({length * k // (count + 1) for k in range(1, count + 1)} & set(range(1, length)))


def state_advantages(
    rewards: torch.Tensor, keys: torch.Tensor, set_size: int, num_sets: int | None, scale: bool,
    generator: torch.Generator,
) -> tuple[torch.Tensor, float]:
    """Set advantages of the N trajectories of one rollout state.

    Args:
        rewards: (N,) rewards of the rollout's continuation (index 0) and its N - 1 vines; keys: (N,) diversity keys.
        scale: divide by the std of the state's set scores (+ 1e-4).
    Returns:
        ((N,) advantages, NaN as 0; mean set score).
    """
    sets = draw_sets(rewards.numel(), set_size, num_sets, generator)
    adv, scores, _ = set_advantages(rewards.view(1, -1), keys.view(1, -1), sets.unsqueeze(0))
    values = adv[0]
    if scale:
        values = values / (score_std(scores, "group")[0, 0] + 1e-4)
    return torch.nan_to_num(values, nan=0.0), float(scores.mean())


def state_advantage(
    rewards: torch.Tensor, keys: torch.Tensor, set_size: int, num_sets: int | None, scale: bool,
    generator: torch.Generator,
) -> tuple[float, float]:
    """:func:`state_advantages` of member 0 (the rollout itself): (its advantage, mean set score)."""
    values, mean_score = state_advantages(rewards, keys, set_size, num_sets, scale, generator)
    return float(values[0]), mean_score


def vine_slot(index_in_group: int, tree_size: int, per_state: int) -> tuple[int, int] | None:
    """``(root, state)`` of a vine row: its tree's root (index in group) and which of the root's states it continues;
    None for a root. Rows ``m L .. m L + L - 1`` form tree ``m``: the root, then the ``vines - 1`` vines of state 0,
    then those of state 1, ..."""
    j = index_in_group % tree_size
    return None if j == 0 else (index_in_group - j, (j - 1) // per_state)


def state_seed(seed: int, step: int, root: int, state: int) -> int:
    """Seed of one rollout state's set draws (the same on every process): from the run seed, the step, the root's
    global row index and the state index."""
    return ((seed * 1_000_003 + step) * 1_000_003 + root) * 31 + state


def window_advantages(
    base: torch.Tensor, vines: list[list[list[float]] | None], width: int, window: int
) -> torch.Tensor:
    """Token advantages: each row's root advantage, and on the ``window`` tokens from each vine state ``c``
    (positions ``c .. c + window - 1``) that state's set advantage (a later state overrides an overlap).

    Args:
        base: (N,) root set advantages. vines: per row ``[[c, advantage], ...]`` or None. width: T_max.
    Returns:
        (N, width) advantages.
    """
    out = base.view(-1, 1).expand(-1, width).clone()
    for n, states in enumerate(vines):
        for c, value in states or []:
            out[n, int(c) : min(int(c) + window, width)] = value
    return out


class PolychromicPlugin(Plugin):
    """Set-level reward x diversity advantages (reward stage reads the answers; advantage stage)."""

    name = "polychromic"
    image_inputs = True
    multi_turn = True
    version = "0.2.0"
    paper = "Polychromic Objectives for Reinforcement Learning, arXiv:2509.25424"
    summary = "Advantages from sets of rollouts scored by mean reward x diversity: rewards diverse successes."
    Options = PolychromicOptions
    official = OfficialSource(
        None, verdict="reconstructed",
        note="No public repository was found; the set advantage and vine sampling follow the paper's text "
        "(Algorithm 2, Table 3 defaults read through summaries and public replications). The text diversity function "
        "(distinct answers) is ours; the vines are sampled through the branching seam and trained as rows of the "
        "group (vine_rows='trained'; 'scored' is a cheaper variant).",
        non_official_defaults={"rollout_states": "2 (paper Table 3); 0 here: each state costs vines - 1 extra "
                                                 "generations per rollout"},
    )
    claim_metric = ("set_diversity", "fraction of distinct rollouts per set")
    replaces = ("the advantages",)
    overwrites = ("advantages",)  # recomputed from the rewards: runs first in the advantage chain
    reconstructed = (
        "diversity for text: distinct final answers (or whole completions); the paper's tasks use visited rooms",
        "a rollout in several sets takes the mean of their advantages; a rollout in no set gets 0",
        "the set advantage is divided by the std of the set scores as TRL's scale_rewards divides rewards",
        "a completion without an answer is distinct from all others (unanswered='singleton')",
        "vine sampling: states evenly spaced; the window counts tokens; a vine row's prefix takes its group-level "
        "advantage",
    )

    def __init__(self, options=None):
        super().__init__(options)
        self._keys: torch.Tensor | None = None
        self._scale_rewards = "group"
        self._pending = False  # the prompt stage deferred the vine rows of this step

    @hookimpl
    def trl_plugins_configure(self, trainer, args):
        o = self.options
        G = args.num_generations
        if o.set_size > G:
            raise PluginConfigError(
                f"Option 'set_size' of plugin 'polychromic' got {o.set_size!r} with num_generations={G}; "
                f"allowed: 1 <= set_size <= num_generations."
            )
        if o.num_sets is None and math.comb(G, o.set_size) > MAX_EXHAUSTIVE_SETS:
            raise PluginConfigError(
                f"Option 'num_sets' of plugin 'polychromic' is None (every subset) but C({G}, {o.set_size}) = "
                f"{math.comb(G, o.set_size)} sets per group; allowed: at most {MAX_EXHAUSTIVE_SETS}, or set num_sets."
            )
        if o.set_size == G and o.num_sets is not None:
            warnings.warn(
                "polychromic: set_size equals num_generations, so every drawn set is the whole group and every "
                "advantage is 0; use a smaller set_size.",
                stacklevel=2,
            )
        self._scale_rewards = args.scale_rewards
        if o.tree_size > G:
            raise PluginConfigError(
                f"Options of plugin 'polychromic': a tree of 1 + rollout_states * (vines - 1) = 1 + {o.rollout_states} "
                f"* ({o.vines} - 1) = {o.tree_size} rows does not fit in a group of num_generations={G}; allowed: "
                f"num_generations >= {o.tree_size}, fewer rollout_states / vines, or vine_rows='scored'.")
        deferring = [p.name for p in getattr(trainer, "plugin_stack", None) or []
                     if p is not self and getattr(getattr(p, "options", None), "branch_rollouts", 0)]
        if o.tree_size > 1 and deferring:
            raise IncompatiblePluginsError(
                f"polychromic with trained vines (vine_rows='trained') and {deferring} with branch_rollouts > 0 both "
                "defer rows of every group to fill them with continuations; set vine_rows='scored' or "
                "branch_rollouts=0.")
        if o.rollout_states and samples_outside_hf_generate(args):
            raise IncompatiblePluginsError(
                f"polychromic's vine sampling (rollout_states={o.rollout_states}) cannot run with use_vllm=True or "
                f"continuous batching: {VLLM_BRANCHING} Set rollout_states=0 or use HF generation."
            )

    def hook_enabled(self, hook: str) -> bool:
        if hook == "trl_plugins_generation_prompts":
            return self.options.tree_size > 1
        return hook != "trl_plugins_after_generation" or self.options.rollout_states > 0

    def multi_turn_refusal(self) -> str | None:
        if self.options.rollout_states > 0:
            return ("its vines continue through the branching seam, which samples single-turn text without running "
                    "tools; set rollout_states=0 for tool rollouts.")
        return None

    def _text_key(self, text: str) -> str | None:
        """The diversity key of one completion text (an answer, the whole text, or the text itself when off)."""
        o = self.options
        if o.diversity == "answers":
            return get_extractor(o.extractor)(text)
        return text

    @hookimpl
    def trl_plugins_generation_prompts(self, ctx: PromptContext):
        """Trained vines: defer every vine row, TRL samples the tree roots only."""
        L = self.options.tree_size
        ctx.defer_slots(lambda k: k % L != 0)
        self._pending = True  # on every process, whatever its rows: the next hook's collectives run everywhere

    def _fill_vine_rows(self, ctx: RolloutContext) -> None:
        """Fill each vine row with a continuation of its root from the root's state (collective: one gather and one
        branching call on every process)."""
        o, G, B, L = self.options, ctx.num_generations, len(ctx), self.options.tree_size
        roots = {i for i in range(B) if ctx.index_in_group[i] % L == 0}
        root_ids = gather_id_lists(ctx, [ctx.completion_ids[i] if i in roots else [] for i in range(B)])
        limit = ctx.run.max_completion_length
        rows, prompts, prefixes, room, notes = [], [], [], [], []
        for i in range(B):
            slot = vine_slot(ctx.index_in_group[i], L, o.vines - 1)
            if slot is None:
                continue
            ids = root_ids[ctx.group_ids[i] * G + slot[0]]
            states = rollout_positions(len(ids), o.rollout_states) or [0]  # a one-token root: a fresh sample
            c = min(states[slot[1] % len(states)], limit - 1)
            rows.append(i)
            prompts.append(list(ctx.prompt_ids[i]))
            prefixes.append(ids[:c])
            room.append(limit - c)
            notes.append([slot[0], slot[1], c])
        continuations = ctx.continue_prefixes(prompts, prefixes, room)  # collective, even with no request
        for i, cont, note in zip(rows, continuations, notes):
            lps = None if ctx.sampling_logprobs is None else [float("nan")] * note[2] + list(cont.logprobs)
            ctx.replace_row(i, cont.completion_ids, logprobs=lps)
            ctx.annotations[i][VINE_ROW_KEY] = note
        ctx.log_metric("extra_rollouts", 0.0)  # the vines are rows of the group: no generation beyond G per group
        ctx.log_metric("vine_rows", float(len(rows)))

    @hookimpl
    def trl_plugins_after_generation(self, ctx: RolloutContext):
        """Vine sampling: fill the vine rows (``vine_rows="trained"``), or continue every rollout from its rollout states, N - 1 times each, and score the sets of the
        N trajectories of each state (the rollout's own continuation is member 0)."""
        o = self.options
        if o.vine_rows == "trained":
            if self._pending:  # not in a refill round: its rows were sampled independently
                self._pending = False
                self._fill_vine_rows(ctx)
            return
        limit = ctx.run.max_completion_length
        plan, prompts, prefixes, room = [], [], [], []
        for i, ids in enumerate(ctx.completion_ids):
            states = [c for c in rollout_positions(len(ids), o.rollout_states) if limit is None or c < limit]
            plan.append(states)
            for c in states:
                prompts += [list(ctx.prompt_ids[i])] * (o.vines - 1)
                prefixes += [list(ids[:c])] * (o.vines - 1)
                room += [(limit if limit is not None else len(ids)) - c] * (o.vines - 1)
        # one call on every process, with no request too: generation is a collective
        continuations = ctx.continue_prefixes(prompts, prefixes, room)
        rows = [i for i, states in enumerate(plan) for _ in range(len(states) * (o.vines - 1))]
        texts = [ctx.decode(c.completion_ids, i) for c, i in zip(continuations, rows)]
        own = [i for i, states in enumerate(plan) if states]
        scores = ctx.score(rows + own, texts + [ctx.completions[i] for i in own]).float() if own else torch.zeros(0)
        own_score = dict(zip(own, scores[len(rows):].tolist()))
        own_key = {i: self._text_key(completion_text(ctx.completions[i])) for i in own}
        scale = self._scale_rewards != "none"
        k, set_scores = 0, []
        for i, states in enumerate(plan):
            values = []
            for s_index, c in enumerate(states):
                block = slice(k, k + o.vines - 1)
                k += o.vines - 1
                rewards = torch.tensor([own_score[i]] + scores[block].tolist()).nan_to_num(0.0)
                answers = [own_key[i]] + [self._text_key(completion_text(t)) for t in texts[block]]
                if o.diversity == "off":
                    keys = torch.arange(o.vines)
                else:
                    keys = group_keys([cluster_answers(answers)], o.unanswered if o.diversity == "answers"
                                      else "singleton")
                generator = torch.Generator().manual_seed(state_seed(o.seed, ctx.step, ctx.global_index[i], s_index))
                value, mean_score = state_advantage(rewards, keys, o.set_size, o.num_sets, scale, generator)
                values.append([c, value])
                set_scores.append(mean_score)
            ctx.annotations[i][VINES_KEY] = values
        ctx.log_metric("extra_rollouts", len(prefixes))
        ctx.log_metric("vine_set_score", sum(set_scores) / len(set_scores) if set_scores else 0.0)

    @hookimpl
    def trl_plugins_transform_rewards(self, ctx: RewardContext):
        o = self.options
        if o.diversity == "off":
            self._keys = torch.arange(ctx.rewards_per_func.size(0))  # all distinct: d = 1
            return
        extractor = o.extractor if o.diversity == "answers" else whole_text
        _, cluster_ids = batch_clusters(ctx, extractor)
        self._keys = group_keys(cluster_ids, o.unanswered if o.diversity == "answers" else "singleton")

    @hookimpl
    def trl_plugins_transform_advantages(self, ctx: AdvantageContext):
        o = self.options
        G = ctx.num_generations
        keys, self._keys = self._keys, None
        if keys is None or keys.numel() != ctx.rewards.numel():
            raise PluginConfigError("polychromic: no diversity keys for this batch (the reward stage did not run).")
        if o.set_size > G:  # evaluation with fewer generations: nothing to score as sets
            return
        adv, stats = polychromic_advantages(
            ctx.rewards, keys, G, o.set_size, o.num_sets, self._scale_rewards, o.seed, ctx.step
        )
        vines = [note.get(VINES_KEY) for note in ctx.annotations]
        if o.vine_rows == "trained" and o.rollout_states:
            vines = self._vine_row_states(ctx, keys)
        if o.rollout_states and ctx.mode == "train":
            width = ctx.completion_mask().size(1)  # collective: every process, every training batch
            if any(vines):  # rows of a refill round carry no vine states: they keep the root advantage
                adv = window_advantages(adv.float().cpu(), vines, width, o.window)
            ctx.log_metric("vine_states", float(sum(len(v or []) for v in vines)) / max(len(vines), 1))
        ctx.advantages = adv.to(device=ctx.advantages.device, dtype=ctx.advantages.dtype)
        for key, value in stats.items():
            ctx.log_metric(key, value)
        ctx.log_metric("abs_advantage", adv.abs().mean().item())

    def _vine_row_states(self, ctx: AdvantageContext, keys: torch.Tensor) -> list[list[list[float]] | None]:
        """Trained vines: per row ``[[c, set advantage]]`` at its state, for each root (every state it has vines of)
        and each vine row; the state's N trajectories are the root and its vine rows of that state (a state with
        fewer than ``set_size`` of them keeps the group-level advantage). Args: keys (N,) diversity keys."""
        o = self.options
        members: dict[tuple[int, int], list[int]] = {}  # (root row, state) -> vine rows
        cut: dict[tuple[int, int], int] = {}
        for n, note in enumerate(ctx.annotations):
            slot = note.get(VINE_ROW_KEY)
            if slot is not None:
                key = (n - int(ctx.index_in_group[n]) + int(slot[0]), int(slot[1]))
                members.setdefault(key, []).append(n)
                cut[key] = int(slot[2])
        out: list[list[list[float]] | None] = [None] * len(ctx.annotations)
        rewards = torch.nan_to_num(ctx.rewards.float().cpu(), nan=0.0)
        scale = self._scale_rewards != "none"
        scores = []
        for (root, state), vine_rows in sorted(members.items()):
            rows = [root] + vine_rows
            if len(rows) < o.set_size:
                continue
            generator = torch.Generator().manual_seed(state_seed(o.seed, ctx.step, root, state))
            values, mean_score = state_advantages(rewards[rows], keys[rows].cpu(), o.set_size, o.num_sets, scale,
                                                  generator)
            scores.append(mean_score)
            for n, value in zip(rows, values.tolist()):
                out[n] = (out[n] or []) + [[cut[(root, state)], value]]
        for states in out:
            if states:
                states.sort(key=lambda item: item[0])  # a later state overrides an overlap
        if scores:
            ctx.log_metric("vine_set_score", sum(scores) / len(scores))
        return out

"""LATR — lookahead tree-based rollouts (arXiv:2510.24302).

The G rollouts of a prompt are grown as a tree instead of being sampled independently, so that they differ at the
trajectory level and not only in a few tokens. Facts from the official code (starreeze/latr @ 2adb0ed, HF-generate
decoding loop ``model/generation.py``, filters ``model/sample_filter.py``, defaults ``model/utils.py``):

* **Branching** (``ProbFilter``, sample_filter.py:41-63; used at generation.py:195-206): at a decoding step the
  policy's top-``m`` tokens (``max_n_branch_per_token``, default 2) are candidates; the most likely one is the
  branch's own continuation, and candidate ``i >= 1`` opens a new branch when ``p_i > tau_abs`` and
  ``p_0 - p_i < tau_rel`` (defaults 0.25 and 0.15, utils.py:30-31; the countdown script the same, the math script
  0.15 / 0.25). A root holds at most ``kt_n_gen`` live branches; when more candidates pass, the earlier ones win
  (by candidate rank, then row, generation.py:224-240).
* **Lookahead pruning** (``RolloutFilter``, sample_filter.py:229-346): ``r`` tokens after its birth (``r`` in
  ``rollout_filter_steps`` = 20, 30, 50) a branch's last ``r`` tokens ``a`` are compared with its parent's tokens at
  the same positions ``b``; it is removed when ``edit_distance(a, b) / r < tau_ed`` (0.4) -- optional criteria:
  suffix match ``> 0.2`` and ROUGE-L ``> 0.5`` (the math script), both off by default. A window holding EOS is not
  compared; with ``keep_math_symbols`` (default on) neither is a fork whose parent token decodes to a math symbol
  (the ``in`` test of sample_filter.py:298-304, so a whitespace token too).
* **Mixing** (``mix_ratio_schedule``, utils.py:42, generation.py:86): ``round(G * eta)`` rows of a group come from
  the tree, the rest are ordinary samples; eta follows a step schedule (default ``{0: 1.0}``; the scripts decay it).
* **Filling** (``fill_return_sequences``, generation.py:619-621): a tree that ends with fewer branches than its rows
  fills them with copies of its first row.

Mapping onto TRL (a deliberate approximation: the official loop branches token by token inside its own decoding
loop; TRL samples whole completions, so the tree is grown after generation through the branching seam). Row 0 of a
group is the tree's root and is sampled by TRL; the other tree rows (``1 .. round(G eta) - 1``) are deferred
(``PromptContext.defer``). The after-generation hook then runs up to ``rounds`` rounds, each with the same number of
collective calls on every process (a group may straddle processes; the tree state is gathered and identical
everywhere, and each process generates for its own rows):

1. *probe*: the policy's top-``m`` distribution at every position of the members added in the last round (for the
   root: all its positions; for a branch: the positions after its fork), from a teacher-forced forward
   (``ctx.continue_prefixes`` with ``probe_positions``); the positions and candidates that pass the filter above,
   other than the member's own token, are the tree's pending fork points;
2. *fork + lookahead*: the earliest pending points (by position, then candidate rank, then member) go to the free
   rows; each row forks its member's prefix onto the candidate (``ctx.fork_prefixes``, forced token) and samples
   ``max(pruning_steps)`` tokens ahead;
3. *prune*: the lookahead is compared with the parent as above; a pruned branch frees its row for the next round;
4. *complete*: a surviving branch is sampled to its end (``ctx.continue_prefixes``) and becomes a member whose own
   fork points are probed in the next round.

Rows still free after the last round are filled as in the official code (``fill="duplicate"``, copies of the root)
or by independent samples (``fill="sample"``, ours). Each seam request counts as one completion in the rollout
budget (``plugin_generation_budget``), the probes included; since trees share prefixes, tokens are the fairer count:
the hook logs the generated tokens (root, probes, lookaheads, completions) against the tokens of the trained tree
rows (``generated_tokens``, ``trained_tree_tokens``, ``generated_token_fraction``).

Deviations and reconstructed details:

* the official tree follows the most likely token between forks (``sample_nk="none"``, generation.py:256-299) and
  samples only once the tree is full (vLLM continuation, ``kt_mixed_engine``); here every token that is not forced
  at a fork is sampled at the run's temperature, so the lookahead windows that pruning compares are sampled;
* forks are decided per round over complete members (earliest first), not token by token across live branches;
  the number of rounds (``rounds``) is ours;
* the branching probabilities are the policy's at the run's temperature (the official filter reads the untempered
  softmax; identical at temperature 1, the official rollout temperature);
* a window that reaches the end of a sequence counts as holding EOS (not compared);
* the root is a sampled rollout (officially the greedy trunk of the tree);
* the adaptive threshold scheduler (``enable_param_scheduler``, off in the scripts) and the learned pruning model
  are not ported.

Neutral setting: ``mix_ratios=[0.0]`` (no tree rows) leaves the run vanilla TRL (no hook runs).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from trl_plugins.api import IncompatiblePluginsError, OfficialSource, Plugin, PluginConfigError, PluginOptions
from trl_plugins.api import PromptContext, RolloutContext, hookimpl, option
from trl_plugins.api.collectives import gather_id_lists
from trl_plugins.api.reasons import IMAGES_GENERATION_SERVICE, VLLM_BRANCHING, samples_outside_hf_generate

#: The official ``math_core_symbols`` (sample_filter.py:18): a fork whose parent token decodes (stripped) to a
#: substring of it is never pruned when ``keep_math_symbols`` is on.
MATH_SYMBOLS = "+-*/\\<>=()[]{}_^&%$0123456789"
#: Annotation keys of a tree row: the index in group of its parent (-1: the root or a filled row), its fork position.
PARENT_KEY = "latr_parent"
FORK_KEY = "latr_fork"


def _refuse(name: str, value, allowed: str) -> None:
    raise PluginConfigError(f"Option '{name}' of plugin 'latr' got {value!r}; allowed: {allowed}.")


@dataclass
class LatrOptions(PluginOptions):
    mix_ratios: list[float] = option(
        default_factory=lambda: [1.0],
        help="eta: fraction of each group grown as a tree (round(G * eta) rows, the rest sampled independently), one "
        "value per schedule stage (official default {0: 1.0}; the scripts decay it). [0.0]: vanilla TRL.",
    )
    mix_ratio_steps: list[int] = option(
        default_factory=lambda: [0],
        help="First optimizer step of each mix_ratios stage (starts at 0, increasing; one per ratio).",
    )
    max_branch_per_token: int = option(
        2, min=2, help="m: the top-m tokens of a position are its candidates (official max_n_branch_per_token: 2).",
    )
    prob_abs_threshold: float | None = option(
        0.25, min=0.0, max=1.0, help="tau_abs: a candidate forks only when its probability is above this (official "
        "0.25; the math script 0.15). None: no absolute test.",
    )
    prob_rel_threshold: float | None = option(
        0.15, min=0.0, max=1.0, help="tau_rel: ... and when the top token's probability exceeds its own by less than "
        "this (official 0.15; the math script 0.25). None: no relative test.",
    )
    pruning_steps: list[int] = option(
        default_factory=lambda: [20, 30, 50],
        help="r: lookahead lengths at which a new branch is compared with its parent (official rollout_filter_steps); "
        "the lookahead samples max(r) tokens.",
    )
    edit_distance_threshold: float | None = option(
        0.4, min=0.0, help="tau_ed: prune when token edit distance / r is below this (official 0.4). None: off.",
    )
    suffix_match_threshold: float | None = option(
        None, min=0.0, max=1.0, help="Prune when the longest common suffix match / r is above this (the math script: "
        "0.2). None: off.",
    )
    rouge_l_threshold: float | None = option(
        None, min=0.0, max=1.0, help="Prune when ROUGE-L of the windows is above this (the math script: 0.5). None: off.",
    )
    keep_math_symbols: bool = option(
        True, help="Never prune a fork whose parent token is a math symbol or whitespace (official default).",
    )
    max_fork_position: int = option(
        0, min=0, help="Fork only before this completion position (official force_return_step: 512 countdown, 1024 "
        "math). 0: anywhere.",
    )
    rounds: int = option(
        4, min=1, help="Probe / fork / prune / complete rounds per step (ours: the official loop is token by token).",
        reconstructed=True,
    )
    fill: Literal["duplicate", "sample"] = option(
        "duplicate", help="Tree rows left free after the last round: copies of the root ('duplicate', official "
        "fill_return_sequences) or independent samples ('sample', ours).",
    )

    def validate(self) -> None:
        if not self.mix_ratios:
            _refuse("mix_ratios", self.mix_ratios, "at least one ratio")
        if any(not 0.0 <= r <= 1.0 for r in self.mix_ratios):
            _refuse("mix_ratios", self.mix_ratios, "ratios in [0, 1]")
        steps = self.mix_ratio_steps
        if len(steps) != len(self.mix_ratios) or steps[0] != 0 or any(b <= a for a, b in zip(steps, steps[1:])):
            _refuse("mix_ratio_steps", steps, f"{len(self.mix_ratios)} increasing steps starting at 0 (one per ratio)")
        if not self.pruning_steps or any(r < 1 for r in self.pruning_steps):
            _refuse("pruning_steps", self.pruning_steps, "a non-empty list of lookahead lengths >= 1")

    @property
    def lookahead(self) -> int:
        return max(self.pruning_steps)

    @property
    def enabled(self) -> bool:
        return any(r > 0 for r in self.mix_ratios)


# ============================================================================================ pure tree logic
def mix_ratio(ratios: list[float], steps: list[int], step: int) -> float:
    """eta at optimizer step ``step``: the ratio of the last stage that has started (official ``set_step``)."""
    k = max(j for j, s in enumerate(steps) if s <= step)
    return ratios[k]


def tree_rows(num_generations: int, ratio: float) -> int:
    """Rows of a group grown as a tree: ``round(G eta)`` (Python's rounding, as the official code)."""
    return round(num_generations * ratio)


def branch_tokens(top_ids: list[int], top_probs: list[float], own: int, m: int,
                  abs_threshold: float | None, rel_threshold: float | None) -> list[tuple[int, int]]:
    """The forks at one position: ``(rank, token)`` of the top-``m`` candidates that pass the probability filter,
    other than the token the member took there (``own``).

    Candidate 0 (the most likely) always passes; candidate ``i >= 1`` passes when ``p_i > abs_threshold`` and
    ``p_0 - p_i < rel_threshold`` (a None threshold skips its test).

    Args:
        top_ids, top_probs: the most likely next tokens there and their probabilities, most likely first (>= m).
    """
    out = []
    for i in range(min(m, len(top_ids))):
        if i > 0:
            if abs_threshold is not None and not top_probs[i] > abs_threshold:
                continue
            if rel_threshold is not None and not top_probs[0] - top_probs[i] < rel_threshold:
                continue
        if top_ids[i] != own:
            out.append((i, int(top_ids[i])))
    return out


def edit_distance(a: list[int], b: list[int]) -> int:
    """Levenshtein distance between two token lists (insert, delete, substitute: cost 1)."""
    prev = list(range(len(b) + 1))
    for i, x in enumerate(a, 1):
        cur = [i] + [0] * len(b)
        for j, y in enumerate(b, 1):
            cur[j] = min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (x != y))
        prev = cur
    return prev[-1]


def _longest_prefix_in(pattern: list[int], text: list[int]) -> int:
    """Largest L such that ``pattern[:L]`` occurs contiguously in ``text``."""
    best = 0
    for start in range(len(text)):
        n = 0
        while n < len(pattern) and start + n < len(text) and text[start + n] == pattern[n]:
            n += 1
        best = max(best, n)
    return best


def suffix_match(a: list[int], b: list[int]) -> float:
    """Longest suffix of one window found anywhere in the other, over the window length (official metric)."""
    ra, rb = a[::-1], b[::-1]
    return max(_longest_prefix_in(ra, rb), _longest_prefix_in(rb, ra)) / len(a)


def rouge_l(a: list[int], b: list[int]) -> float:
    """ROUGE-L F1 of two token lists (longest common subsequence)."""
    if not a or not b:
        return 0.0
    prev = [0] * (len(b) + 1)
    for x in a:
        cur = [0] * (len(b) + 1)
        for j, y in enumerate(b, 1):
            cur[j] = prev[j - 1] + 1 if x == y else max(prev[j], cur[j - 1])
        prev = cur
    lcs = prev[-1]
    if lcs == 0:
        return 0.0
    p, r = lcs / len(a), lcs / len(b)
    return 2 * p * r / (p + r)


def too_similar(child: list[int], parent: list[int], t: int, o: LatrOptions, eos: int | None,
                keep: bool = False) -> bool:
    """Whether a branch born at completion position ``t`` (its token ``t`` differs from its parent's) is pruned.

    For each lookahead length ``r`` the windows ``child[t:t+r]`` and ``parent[t:t+r]`` are compared; a window that
    holds ``eos`` or reaches the end of either sequence is skipped, and ``keep`` (the parent's fork token is a math
    symbol) skips them all. Pruned when any window fails any enabled criterion.
    """
    if keep:
        return False
    for r in o.pruning_steps:
        if len(child) <= t + r or len(parent) <= t + r:
            continue
        a, b = child[t:t + r], parent[t:t + r]
        if eos is not None and (eos in a or eos in b):
            continue
        if o.edit_distance_threshold is not None and edit_distance(a, b) / r < o.edit_distance_threshold:
            return True
        if o.suffix_match_threshold is not None and suffix_match(a, b) > o.suffix_match_threshold:
            return True
        if o.rouge_l_threshold is not None and rouge_l(a, b) > o.rouge_l_threshold:
            return True
    return False


def keeps_math_symbol(text: str) -> bool:
    """The official test ``decode([token]).strip() in math_core_symbols`` (substring; the empty string passes)."""
    return text.strip() in MATH_SYMBOLS


def assign_forks(points: list[tuple[int, int, int]], free: list[int]) -> list[tuple[int, tuple[int, int, int]]]:
    """Give the earliest pending fork points ``(position, rank, member)`` to the free rows (lowest row first)."""
    return list(zip(sorted(free), sorted(points)))


@dataclass
class _Tree:
    """One group's tree, identical on every process: members by index in group, their fork, pending points."""

    members: dict[int, list[int]] = field(default_factory=dict)  # slot -> completion ids
    birth: dict[int, int] = field(default_factory=dict)  # slot -> fork position (-1: root)
    parent: dict[int, int] = field(default_factory=dict)
    points: list[tuple[int, int, int]] = field(default_factory=list)  # (position, rank, member slot)
    unprobed: list[int] = field(default_factory=list)
    free: list[int] = field(default_factory=list)


class LatrPlugin(Plugin):
    """Lookahead tree-based rollouts: forks at uncertain tokens, pruning of look-alike branches."""

    name = "latr"
    version = "0.1.0"
    paper = (
        "Lookahead Tree-Based Rollouts for Enhanced Trajectory-Level Exploration in Reinforcement Learning with "
        "Verifiable Rewards, arXiv:2510.24302"
    )
    summary = "Group grown as a tree: forks at uncertain tokens, lookahead pruning of branches too close to their parent."
    Options = LatrOptions
    image_inputs = True
    multi_turn = True
    official = OfficialSource(
        "starreeze/latr", "2adb0edf24cc9a9342ac021892897adcec1a2738", verdict="faithful",
        files=("model/generation.py", "model/sample_filter.py", "model/utils.py", "model/metrics.py",
               "scripts/grpo-kt-countdown.sh", "scripts/grpo-kt-math.sh"),
        note="The branching filter, the pruning criteria and windows, the mix ratio and the filling follow the "
        "official code; the tree is grown in rounds after TRL's generation through the branching seam instead of "
        "token by token in a custom decoding loop, and non-forced tokens are sampled (officially greedy until the "
        "tree is full).",
        variants=("fill",),
    )
    claim_metric = ("generated_token_fraction", "generated tokens / tokens of the trained tree rows (shared prefixes)")
    reconstructed = (
        "the tree grows in rounds after generation (probe, fork + lookahead, prune, complete), not token by token",
        "tokens between forks are sampled at the run's temperature (officially the most likely token until the tree "
        "is full)",
        "the root is a sampled rollout (officially the greedy trunk)",
        "the number of rounds",
        "a window reaching the end of a sequence counts as holding EOS",
    )

    def __init__(self, options=None):
        super().__init__(options)
        self._tree_rows = 0  # rows per group grown as a tree this step (0: none deferred)

    # ----------------------------------------------------------------------------------------- checks
    def hook_enabled(self, hook: str) -> bool:
        return self.options.enabled

    def image_inputs_refusal(self) -> str | None:
        if self.options.enabled:
            return f"with mix_ratios={self.options.mix_ratios}, {IMAGES_GENERATION_SERVICE}"
        return None

    def multi_turn_refusal(self) -> str | None:
        if self.options.enabled:
            return ("LATR's branches continue through the branching seam, which samples single-turn text without "
                    "running tools; set mix_ratios=[0.0] for tool rollouts.")
        return None

    @hookimpl
    def trl_plugins_configure(self, trainer, args):
        if samples_outside_hf_generate(args):
            raise IncompatiblePluginsError(
                f"latr with mix_ratios={self.options.mix_ratios} cannot run with use_vllm=True or continuous "
                f"batching: {VLLM_BRANCHING} Or set mix_ratios=[0.0] (independent rollouts).")

    # ----------------------------------------------------------------------------------------- prompt stage
    @hookimpl
    def trl_plugins_generation_prompts(self, ctx: PromptContext):
        """Defer the tree rows but the root: TRL samples the root and the independent rows."""
        o = self.options
        self._tree_rows = tree_rows(ctx.num_generations, mix_ratio(o.mix_ratios, o.mix_ratio_steps, ctx.step))
        if self._tree_rows < 2:
            self._tree_rows = 0
            return
        K = self._tree_rows
        ctx.defer_slots(lambda k: 0 < k < K)

    # ----------------------------------------------------------------------------------------- tree
    @hookimpl
    def trl_plugins_after_generation(self, ctx: RolloutContext):
        """Grow each group's tree (collective: the same calls on every process, see the module docstring)."""
        K, self._tree_rows = self._tree_rows, 0
        if K == 0:  # nothing deferred (eta too small, or a refill round sampled its rows independently)
            return
        o, G, B = self.options, ctx.num_generations, len(ctx)
        tok = ctx.tokenizer
        eos = getattr(tok, "eos_token_id", None)
        glob = [ctx.group_ids[i] * G + ctx.index_in_group[i] for i in range(B)]
        local = {g: i for i, g in enumerate(glob)}
        roots = gather_id_lists(ctx, [ctx.completion_ids[i] if ctx.index_in_group[i] == 0 else [] for i in range(B)])
        trees = {}
        for g in range(len(roots) // G):  # every group of the global batch, on every process
            trees[g] = _Tree(members={0: roots[g * G]}, birth={0: -1}, parent={0: -1}, unprobed=[0],
                             free=list(range(1, K)))
        stats = {"probe_tokens": 0, "new_tokens": 0, "pruned": 0, "kept": 0, "forks": 0, "fork_position": 0}
        lps: dict[int, list[float]] = {}  # local row -> sampling log-probs of its new completion
        for _ in range(o.rounds):
            if not any(t.free and (t.points or t.unprobed) for t in trees.values()):
                break  # the same decision on every process (the trees are identical everywhere)
            self._probe(ctx, trees, glob, local, stats)
            self._fork_round(ctx, trees, glob, local, eos, lps, stats)
        self._fill(ctx, trees, local, lps, stats)
        trained = sum(len(ctx.completion_ids[i]) for i in range(B) if ctx.index_in_group[i] < K)
        roots_len = sum(len(ctx.completion_ids[i]) for i in range(B) if ctx.index_in_group[i] == 0)
        generated = roots_len + stats["new_tokens"] + stats["probe_tokens"]
        ctx.log_metric("generated_tokens", float(generated))
        ctx.log_metric("trained_tree_tokens", float(trained))
        ctx.log_metric("generated_token_fraction", generated / max(trained, 1))
        ctx.log_metric("branches_kept", float(stats["kept"]))
        ctx.log_metric("branches_pruned", float(stats["pruned"]))
        ctx.log_metric("rows_filled", float(stats["filled"]))
        if stats["forks"]:
            ctx.log_metric("fork_position", stats["fork_position"] / stats["forks"])

    def _probe(self, ctx, trees, glob, local, stats) -> None:
        """Pending fork points of the members not probed yet (one seam call, two gathers)."""
        o, G = self.options, ctx.num_generations
        rows, prompts, prefixes, positions = [], [], [], []
        for g, t in trees.items():
            for s in t.unprobed:
                i = local.get(g * G + s)
                if i is None:
                    continue
                ids = t.members[s]
                end = len(ids) if o.max_fork_position == 0 else min(len(ids), o.max_fork_position)
                pos = list(range(t.birth[s] + 1, end))
                if not pos:
                    continue
                rows.append((g, s, i))
                prompts.append(list(ctx.prompt_ids[i]))
                prefixes.append(ids[:-1])  # probes at 0 .. len - 1: the distribution of every completion token
                positions.append(pos)
        conts = ctx.continue_prefixes(prompts, prefixes, 1, probe_positions=positions, top_k=o.max_branch_per_token)
        found = [[] for _ in range(len(ctx))]
        for (g, s, i), c in zip(rows, conts):
            stats["probe_tokens"] += len(c.new_ids)
            ids = trees[g].members[s]
            for p in c.probes:
                probs = [math.exp(lp) for lp in p.top_logprobs]
                for rank, _ in branch_tokens(list(p.top_ids), probs, ids[p.position], o.max_branch_per_token,
                                             o.prob_abs_threshold, o.prob_rel_threshold):
                    found[i] += [p.position, rank]
        gathered = gather_id_lists(ctx, found)
        for g, t in trees.items():
            for s in t.unprobed:
                flat = gathered[g * G + s] if g * G + s < len(gathered) else []
                t.points += [(flat[k], flat[k + 1], s) for k in range(0, len(flat), 2)]
            t.unprobed = []

    def _fork_round(self, ctx, trees, glob, local, eos, lps, stats) -> None:
        """Fork the earliest points onto the free rows, look ahead, prune, complete the survivors."""
        o, G, limit = self.options, ctx.num_generations, ctx.run.max_completion_length
        plans = {}
        for g, t in trees.items():
            for slot, point in assign_forks(t.points, t.free):
                plans[(g, slot)] = point
            t.points = sorted(t.points)[len(t.free):]
        mine = [(g, slot, local[g * G + slot]) for (g, slot) in plans if g * G + slot in local]
        prompts, prefixes, ranks, room = [], [], [], []
        for g, slot, i in mine:
            pos, rank, member = plans[(g, slot)]
            prompts.append(list(ctx.prompt_ids[i]))
            prefixes.append(trees[g].members[member][:pos])
            ranks.append(rank)
            room.append(min(o.lookahead, limit - pos))
        conts = ctx.fork_prefixes(prompts, prefixes, ranks, room)
        looked = [[] for _ in range(len(ctx))]
        done = {}
        for (g, slot, i), c in zip(mine, conts):
            looked[i] = list(c.completion_ids)
            lps[i] = [float("nan")] * plans[(g, slot)][0] + list(c.logprobs)
            done[i] = c.finished or len(c.completion_ids) >= limit
            stats["new_tokens"] += len(c.new_ids)
        ahead = gather_id_lists(ctx, looked)
        survivors = {}
        for (g, slot), (pos, rank, member) in plans.items():
            t, child = trees[g], ahead[g * G + slot]
            parent = t.members[member]
            keep = o.keep_math_symbols and pos < len(parent) and keeps_math_symbol(ctx.tokenizer.decode([parent[pos]]))
            if too_similar(child, parent, pos, o, eos, keep):
                stats["pruned"] += 1
                continue
            stats["kept"] += 1
            stats["forks"] += 1
            stats["fork_position"] += pos
            survivors[(g, slot)] = (pos, member)
            t.free.remove(slot)
        todo = [(g, slot, local[g * G + slot]) for (g, slot) in survivors if g * G + slot in local]
        todo = [(g, slot, i) for g, slot, i in todo if not done[i]]
        conts = ctx.continue_prefixes([list(ctx.prompt_ids[i]) for _, _, i in todo], [looked[i] for _, _, i in todo],
                                      [limit - len(looked[i]) for _, _, i in todo])
        for (g, slot, i), c in zip(todo, conts):
            looked[i] = list(c.completion_ids)
            lps[i] += list(c.logprobs)
            stats["new_tokens"] += len(c.new_ids)
        for (g, slot), (pos, member) in survivors.items():
            i = local.get(g * G + slot)
            if i is not None:
                self._replace(ctx, i, looked[i], lps[i])
                ctx.annotations[i].update({PARENT_KEY: member, FORK_KEY: pos})
        full = gather_id_lists(ctx, [looked[i] if (ctx.group_ids[i], ctx.index_in_group[i]) in survivors else []
                                     for i in range(len(ctx))])
        for (g, slot), (pos, member) in survivors.items():
            t = trees[g]
            t.members[slot], t.birth[slot], t.parent[slot] = full[g * G + slot], pos, member
            t.unprobed.append(slot)

    def _fill(self, ctx, trees, local, lps, stats) -> None:
        """Rows still free: copies of the root (official) or independent samples (one seam call, always)."""
        G = ctx.num_generations
        free = [(g, s, local[g * G + s]) for g, t in trees.items() for s in t.free if g * G + s in local]
        stats["filled"] = len(free)
        if self.options.fill == "sample":
            conts = ctx.continue_prefixes([list(ctx.prompt_ids[i]) for _, _, i in free], [[] for _ in free],
                                          ctx.run.max_completion_length)
            for (g, s, i), c in zip(free, conts):
                stats["new_tokens"] += len(c.new_ids)
                self._replace(ctx, i, list(c.completion_ids), list(c.logprobs))
                ctx.annotations[i].update({PARENT_KEY: -1, FORK_KEY: -1})
            return
        for g, s, i in free:
            self._replace(ctx, i, list(trees[g].members[0]), None)
            ctx.annotations[i].update({PARENT_KEY: -1, FORK_KEY: -1})

    @staticmethod
    def _replace(ctx, i: int, ids: list[int], logprobs) -> None:
        lp = None if ctx.sampling_logprobs is None or logprobs is None else logprobs
        ctx.replace_row(i, ids, logprobs=lp)

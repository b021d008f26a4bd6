"""SPO — Segment Policy Optimization (arXiv:2505.23564): Monte-Carlo segment advantages, chain and tree forms.

Between GRPO's one advantage per rollout and PPO's critic per token, SPO credits *segments*: the value of a segment
boundary is estimated by Monte-Carlo samples of the policy itself (no critic), and each segment's tokens get
``V(end) - V(start)``. Two forms, ``mode="chain"`` (the default) and ``mode="tree"``.

**SPO-chain.** Facts from the official code (AIFrameResearch/SPO @ b9fc6a2,
``src/treetune/episode_generators/math_episode_generator_with_mc_advantages.py`` (``MC``),
``src/treetune/trainers/ppo_trainer.py`` (``PPO``), ``src/treetune/trainers/utils.py`` (``U``),
``configs/polIter_qwen05b_spo_chain_gsm8k.jsonnet`` and ``configs/trainers/ppo_MATH.jsonnet``):

1. Cut points (MC:926-929): ``p_t`` the policy's probability of sampled token ``t``; the tokens with
   ``p_t < 0.9`` are candidates, each one's cut point is ``t - 1`` (the boundary just before it), and every
   ``cutpoint_interval``-th candidate is kept (``[::interval]``, interval 5 by default, MC:30). A cut point
   ``c`` is the prefix ``completion[:c + 1]``; ``c = -1`` is the prompt alone.
2. Values (MC:505-536, 985-999; gsm8k chain config: 4 samples, Qwen-1.5B MATH: 9): ``V(c)`` is the mean reward of
   ``mc_samples`` continuations of ``prompt + completion[:c + 1]`` sampled from the current policy; the last token's
   value is the rollout's own reward.
3. Advantages (MC:394-439): walking the tokens, at each token that carries a value the advantage is ``V - V_prev``
   (0 for the first one unless the prompt itself was a cut point, ``c = -1``); every token takes the advantage of
   the next valued token at or after it, i.e. a segment ``(c_{k-1}, c_k]`` gets ``V(c_k) - V(c_{k-1})``; tokens
   with ``p_t > 0.9`` get 0. A rollout without any cut point gets 0 everywhere.
4. Training (ppo_MATH.jsonnet:64, 139; PPO:820-826, 1057-1059; U:266-291): advantages are whitened over the batch's
   tokens with ``p_t < 0.9`` (mean and unbiased variance, ``(A - mean) / sqrt(var + 1e-8)``) and only those tokens
   enter the loss.

Mapping onto TRL: the sampling stage (``trl_plugins_after_generation``) takes ``p_t`` from a no-grad teacher-forced
forward of the current policy (``ctx.policy_logprobs``, temperature applied as TRL applies it), finds the cut points
and asks the branching seam (``ctx.continue_prefixes``: HF generate, collective, counted in the rollout budget; one
call per batch on every process) for ``mc_samples`` continuations of each, up to ``max_completion_length``; the
continuations are scored by TRL's reward functions (``ctx.score``). The advantage stage builds the token advantages
(N, T) from the rollouts' rewards (TRL's combined reward), whitens them over the low-probability tokens of the
batch and sets 0 on the others: they carry no policy gradient (the official code leaves them out of the loss; here
they still count in TRL's loss normaliser, a documented difference). Cost: ``mc_samples`` continuations per cut
point (``max_cutpoints`` caps the cut points per rollout: our option, off by default as in the official code).

**SPO-tree.** Facts from the same commit: the tree sampler ``src/treetune/inference_strategies/
hybrid_inference_strategy.py`` (``H``), the edge extraction ``src/treetune/episode_generators/
tree_episode_generator.py`` (``T``), the episode generator ``src/treetune/episode_generators/
hybrid_episode_generator.py`` (``E``) and the configs ``configs/polIter_qwen05b_spo_tree_gsm8k.jsonnet``,
``configs/polIter_rho1bSft2_spo_tree_GSM8K.jsonnet``, ``configs/polIter_qwen1b_spo_tree_MATH.jsonnet``:

1. Tree (H:333-418; configs: ``max_depth: 3``, branch factors 6-6-6; README also 4-5-6): from the prompt, a node at
   depth ``d`` gets ``b_d`` i.i.d. children sampled from the policy, each at most ``M`` new tokens (H:365; ``M``
   100 by default, H:104, and in the qwen0.5B GSM8K config, 30 for Rho-1B GSM8K, 600 for Qwen-1.5B MATH), except at
   the last depth, whose children run free to the end. A child that finished (not cut by the length) is a leaf
   scored by the reward function (H:394-401); one cut by ``M`` is expanded further; a node at ``max_depth`` is a
   leaf scored on its (truncated) text (H:355-363).
2. Values (H:413-416): a node's value is the mean of its *children's* values (recursively; a leaf's value is its
   reward). In a full tree this is the mean of its subtree's leaf rewards; where some children finished early it
   weighs each child equally, not each leaf.
3. Advantages (T:123-141; ``adv_method`` ``"rloo"`` by default, E:92): every non-root node is a training sample
   (an *edge*: the parent's text as query, the node's segment as response) whose tokens all get
   ``V(node) - V(parent)`` (E:655-657); ``"grpo"`` divides it by the population std of the parent's children's
   values ``+ 1e-8``. Edges whose advantage plus ``BoK(V(node)) - BoK(V(parent))`` (``BoK(v) = 1 - (1 - v)^4``) is 0
   are dropped (T:144-159, ``only_adv_greater_than_zero`` True by default, E:93; for rewards in [0, 1] this drops
   exactly the zero-advantage edges).
4. Training: the same trainer as the chain (whitening over the tokens with ``p_t < 0.9``, only they in the loss).

Mapping onto TRL (``mode="tree"``): the group's G rows are root-to-leaf paths of one tree per prompt. Rows
``1 .. G-1`` of each group are deferred (``PromptContext.defer``); row 0 is TRL's own sample and serves as the tree's
first path (its first ``M`` tokens are one child of the root, the next ``M`` one child of that child, ...: sampling a
segment and then continuing it is the same distribution as sampling the whole). The process holding a group's row 0
grows its tree level by level through the branching seam (``ctx.continue_prefixes``: one collective call per depth
on every process, with no request where a process has no tree), scores the leaves with TRL's reward functions
(``ctx.score``, one call on every process), computes the values and edge advantages, chooses the G leaves of the
rows, and the chosen paths are gathered to the processes holding the group's other rows (one padded gather); a
teacher-forced forward (``ctx.policy_logprobs``) gives ``p_t``. A row's tokens take their segment's edge advantage;
an edge shared by several rows (a common prefix) is trained in the first of them only and is 0 in the others, so
each edge is trained once as in the official code, and dropped edges are 0; the advantage stage then whitens and
masks exactly as the chain. ``max_nodes`` (ours) caps the segments of a tree: each level gives every node to expand
at least one child and the budget that remains is shared out so that every path can still reach the last depth.

Reconstructed / different in the tree form: the rows are G leaves chosen uniformly at random without replacement
(the official code trains every kept edge of the tree through a replay buffer, at most 32 edges per prompt and
iteration, E:26-62, not ported: rows here are this step's tree); a tree with fewer leaves than G fills the rest by
drawing the leaves again (those rows train nothing, their edges being trained once already); ``max_nodes``; row 0 as
the first path; truncated leaves are scored by the reward functions (the official code scores them too at the last
depth, H:357).

Neutral setting: ``weight=0`` generates nothing and keeps TRL's advantages (vanilla GRPO); ``weight`` (ours) mixes
``(1 - w) A_TRL + w A_SPO``, 1 being the official method. Truncated chain continuations are scored by the reward
functions as TRL scores truncated rollouts (the official code gives unfinished responses its penalty, 0.0 in the
released configs).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
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
    RolloutContext,
    hookimpl,
    option,
)
from trl_plugins.api.collectives import context_device
from trl_plugins.api.reasons import IMAGES_GENERATION_SERVICE, VLLM_BRANCHING, samples_outside_hf_generate

#: Annotation keys: the cut points with their values, the low-probability token positions, the completion length.
CUTS_KEY = "spo_cuts"
LOW_KEY = "spo_low"
LENGTH_KEY = "spo_len"
#: Annotation key of a tree row: its segments ``[end, advantage, trained]`` (end exclusive, trained 0 or 1).
SEGMENTS_KEY = "spo_segments"


@dataclass
class SpoOptions(PluginOptions):
    mode: Literal["chain", "tree"] = option(
        "chain", help="'chain': Monte-Carlo values at cut points of each rollout (SPO-chain); 'tree': the group's rows "
        "are leaves of a segment tree per prompt (SPO-tree).",
    )
    prob_threshold: float = option(
        0.9, min=0.0, max=1.0, min_exclusive=True,
        help="Tokens sampled with probability below this are cut-point candidates and the only tokens trained "
        "(official: 0.9).",
    )
    cutpoint_interval: int = option(5, min=1, help="Chain: keep every k-th candidate cut point (official default: 5).")
    mc_samples: int = option(
        4, min=1, help="Chain: Monte-Carlo continuations per cut point that estimate its value (official gsm8k chain: "
        "4).",
    )
    max_cutpoints: int | None = option(
        None, min=1, help="Chain: cut points per rollout at most, the earliest kept (ours; None: all, as official).",
    )
    branch_factors: list[int] = option(
        default_factory=lambda: [6, 6, 6],
        help="Tree: children of a node at each depth; the length is the tree's depth (official 6-6-6; 4-5-6 in the "
        "README).",
    )
    segment_tokens: int = option(
        100, min=1, help="Tree: M, the new tokens of a segment at every depth but the last, which runs to the end "
        "(official default 100; configs 30 Rho-1B GSM8K, 100 Qwen-0.5B GSM8K, 600 Qwen-1.5B MATH).",
    )
    max_nodes: int | None = option(
        None, min=1, help="Tree: segments (nodes but the root) per tree at most, TRL's row 0 included (ours; None: "
        "the full shape, as official). At least the depth and num_generations.",
    )
    tree_advantage: Literal["rloo", "grpo"] = option(
        "rloo", help="Tree: edge advantage V(node) - V(parent) ('rloo', official adv_method default) or divided by "
        "the std of the parent's children's values ('grpo').",
    )
    whiten: bool = option(
        True, help="Whiten the advantages over the batch's low-probability tokens (official ppo_MATH: true).",
    )
    weight: float = option(
        1.0, min=0.0, max=1.0,
        help="A = (1 - weight) A_TRL + weight A_SPO (ours); 1: SPO as published, 0: vanilla TRL (nothing generated).",
    )

    def validate(self) -> None:
        if not self.branch_factors or any(b < 1 for b in self.branch_factors):
            raise PluginConfigError(
                f"Option 'branch_factors' of plugin 'spo' got {self.branch_factors!r}; allowed: a non-empty list "
                "(one entry per depth) of branching factors >= 1, e.g. [6, 6, 6] (official).")
        if self.max_nodes is not None and self.max_nodes < len(self.branch_factors):
            raise PluginConfigError(
                f"Option 'max_nodes' of plugin 'spo' got {self.max_nodes}; allowed: None or at least the tree's depth "
                f"{len(self.branch_factors)} (len(branch_factors)), so that one path reaches the last depth.")

    @property
    def max_leaves(self) -> int:
        """Leaves of the full tree shape (the product of the branching factors)."""
        return math.prod(self.branch_factors)


# ============================================================================================ chain
def cut_points(probs: torch.Tensor, threshold: float, interval: int, limit: int | None = None) -> list[int]:
    """Official cut points of one rollout: ``t - 1`` for every token ``t`` with ``probs[t] < threshold``, every
    ``interval``-th kept, the first ``limit`` of those (all when None). ``-1`` stands for the prompt alone.

    Args:
        probs: (T,) probability of each sampled completion token under the policy.
    """
    candidates = (torch.nonzero(probs < threshold).flatten() - 1).tolist()[::interval]
    return candidates if limit is None else candidates[:limit]


def segment_advantages(length: int, cuts: list[int], values: list[float], reward: float,
                       low: torch.Tensor) -> torch.Tensor:
    """(length,) SPO-chain token advantages of one rollout: segment ``(c_{k-1}, c_k]`` gets ``V(c_k) - V(c_{k-1})``,
    the last segment ``reward - V(c_last)``, the first one 0 unless ``cuts[0] == -1`` (the prompt's value is then its
    start); tokens outside ``low`` ((length,) bool) get 0, and so does every token of a rollout without cut points.
    """
    adv = torch.zeros(length)
    if not cuts or length == 0:
        return adv
    token_values: list[float | None] = [None] * length
    token_values[-1] = reward
    base = None
    if cuts[0] == -1:
        base, cuts, values = values[0], cuts[1:], values[1:]
    for c, v in zip(cuts, values):
        token_values[c] = v
    at: dict[int, float] = {}  # advantage at each valued token: its value minus the previous one
    for t, v in enumerate(token_values):
        if v is not None:
            at[t] = 0.0 if base is None else v - base
            base = v
    current = 0.0
    for t in range(length - 1, -1, -1):  # a token takes the advantage of the next valued token at or after it
        current = at.get(t, current)
        adv[t] = current
    return adv * low[:length].float()


def whiten_over(adv: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``(adv - mean) / sqrt(var + 1e-8)`` with the mean and unbiased variance over ``mask`` (bool, same shape);
    unchanged when fewer than two tokens are in the mask."""
    valid = adv[mask]
    if valid.numel() < 2:
        return adv
    return (adv - valid.mean()) * torch.rsqrt(valid.var(unbiased=True) + 1e-8)


# ============================================================================================ tree
@dataclass
class SegmentTree:
    """One prompt's segment tree. Node 0 is the root (the prompt, no tokens); node ``n`` has ``parent[n]``,
    ``depth[n]`` and ``path[n]``, the completion ids from the root to its end (its segment is
    ``path[n][len(path[parent[n]]):]``); ``leaf[n]`` when it ends the completion; ``reward[n]`` set on leaves."""

    parent: list[int] = field(default_factory=lambda: [-1])
    depth: list[int] = field(default_factory=lambda: [0])
    path: list[list[int]] = field(default_factory=lambda: [[]])
    leaf: list[bool] = field(default_factory=lambda: [False])
    reward: dict[int, float] = field(default_factory=dict)

    def add(self, parent: int, path: list[int], leaf: bool) -> int:
        self.parent.append(parent)
        self.depth.append(self.depth[parent] + 1)
        self.path.append(list(path))
        self.leaf.append(bool(leaf))
        return len(self.parent) - 1

    def children(self, n: int) -> list[int]:
        return [m for m, p in enumerate(self.parent) if p == n]

    @property
    def leaves(self) -> list[int]:
        return [n for n, is_leaf in enumerate(self.leaf) if is_leaf]


def budget_children(wants: list[int], remaining: int | None, levels_left: int) -> list[int]:
    """Children of each node expanded at one depth under a node budget: at least 1 each, at most ``wants[k]``, and
    ``sum * levels_left <= remaining`` so that every new child can still get one descendant per remaining depth
    (``levels_left`` counts this depth). The extra children go round-robin, first node first. ``remaining`` None:
    no budget (``wants``)."""
    if remaining is None:
        return list(wants)
    counts = [1] * len(wants)
    room = remaining // max(levels_left, 1) - len(wants)
    while room > 0 and any(c < w for c, w in zip(counts, wants)):
        for k, w in enumerate(wants):
            if room > 0 and counts[k] < w:
                counts[k] += 1
                room -= 1
    return counts


def tree_values(tree: SegmentTree) -> list[float]:
    """Every node's value: a leaf's reward, else the mean of its children's values (official, H:413-416)."""
    values = [0.0] * len(tree.parent)
    for n in sorted(range(len(tree.parent)), key=lambda m: -tree.depth[m]):  # deepest first
        kids = tree.children(n)
        values[n] = tree.reward[n] if tree.leaf[n] else sum(values[k] for k in kids) / len(kids)
    return values


def _bok(v: float, k: int = 4) -> float:
    return 1 - (1 - v) ** k


def edge_advantages(tree: SegmentTree, values: list[float], method: str = "rloo") -> tuple[list[float], list[bool]]:
    """Every node's edge advantage and whether the edge is kept (T:123-159): ``V(n) - V(parent)`` ('rloo'), divided
    by the population std of the parent's children's values plus 1e-8 ('grpo'); kept when the advantage plus
    ``BoK(V(n)) - BoK(V(parent))`` is not 0. The root's entry is (0, False)."""
    adv, kept = [0.0] * len(values), [False] * len(values)
    for n in range(1, len(values)):
        p = tree.parent[n]
        a = values[n] - values[p]
        if method == "grpo":
            sib = [values[k] for k in tree.children(p)]
            mean = sum(sib) / len(sib)
            a = a / (math.sqrt(sum((v - mean) ** 2 for v in sib) / len(sib)) + 1e-8)
        adv[n] = a
        kept[n] = a + _bok(values[n]) - _bok(values[p]) != 0
    return adv, kept


def choose_leaves(leaves: list[int], count: int, rng: random.Random) -> list[int]:
    """``count`` leaves drawn uniformly without replacement; when the tree has fewer, all of them, then drawn again."""
    out: list[int] = []
    while len(out) < count:
        out += rng.sample(leaves, min(len(leaves), count - len(out)))
    return out


def row_segments(tree: SegmentTree, leaves: list[int], adv: list[float], kept: list[bool]) -> list[list[list[float]]]:
    """Per chosen leaf (in row order), its path's segments ``[end, advantage, trained]`` from the root down: an edge
    is trained in the first row whose path holds it, when kept (each edge trained once)."""
    seen: set[int] = set()
    rows = []
    for leaf in leaves:
        chain, n = [], leaf
        while n > 0:
            chain.append(n)
            n = tree.parent[n]
        segs = []
        for n in reversed(chain):
            segs.append([float(len(tree.path[n])), adv[n], float(kept[n] and n not in seen)])
            seen.add(n)
        rows.append(segs)
    return rows


def tree_token_advantages(length: int, segments: list[list[float]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(length,) token advantages of a tree row and (length,) bool of its trained segments' tokens: the tokens of a
    segment ``[start, end)`` take its advantage when it is trained, else 0."""
    adv, trained = torch.zeros(length), torch.zeros(length, dtype=torch.bool)
    start = 0
    for end, a, on in segments:
        end = min(int(end), length)
        if on:
            adv[start:end] = a
            trained[start:end] = True
        start = end
    return adv, trained


def _parse_slot(payload: list[float], slot: int) -> tuple[list[int], list[list[float]]]:
    """Slot ``slot`` of a group's gathered payload (``[len, *ids, n_seg, *(end, adv, trained)]`` per row)."""
    at = 0
    for k in range(slot + 1):
        n = int(payload[at])
        ids = [int(x) for x in payload[at + 1 : at + 1 + n]]
        at += 1 + n
        m = int(payload[at])
        flat = payload[at + 1 : at + 1 + 3 * m]
        at += 1 + 3 * m
        if k == slot:
            return ids, [[flat[3 * s], flat[3 * s + 1], flat[3 * s + 2]] for s in range(m)]
    raise AssertionError("unreachable")


class SpoPlugin(Plugin):
    """Monte-Carlo segment advantages V(end) - V(start): cut points of each rollout (SPO-chain) or segment trees whose
    leaves form the group (SPO-tree)."""

    name = "spo"
    version = "0.2.0"
    paper = "Segment Policy Optimization: Improved Credit Assignment in Reinforcement Learning for LLMs (SPO), " \
        "arXiv:2505.23564"
    summary = "Segment advantages from Monte-Carlo values: cut points at low-probability tokens (chain) or segment " \
        "trees whose leaves form the group (tree)."
    Options = SpoOptions
    image_inputs = IMAGES_GENERATION_SERVICE
    multi_turn = (
        "its Monte-Carlo continuations and tree segments run through the branching seam, which samples single-turn "
        "text without running tools, so they would not continue the same multi-turn episode."
    )
    official = OfficialSource(
        "AIFrameResearch/SPO", "b9fc6a2", verdict="faithful",
        files=(
            "src/treetune/episode_generators/math_episode_generator_with_mc_advantages.py",
            "src/treetune/trainers/ppo_trainer.py",
            "src/treetune/trainers/utils.py",
            "configs/polIter_qwen05b_spo_chain_gsm8k.jsonnet",
            "configs/trainers/ppo_MATH.jsonnet",
            "src/treetune/inference_strategies/hybrid_inference_strategy.py",
            "src/treetune/episode_generators/tree_episode_generator.py",
            "src/treetune/episode_generators/hybrid_episode_generator.py",
            "configs/polIter_qwen05b_spo_tree_gsm8k.jsonnet",
            "configs/polIter_qwen1b_spo_tree_MATH.jsonnet",
        ),
        note="Both forms. High-probability tokens get advantage 0 (the official code leaves them out of the loss, so "
        "they still count in TRL's normaliser); continuations are scored by TRL's reward functions, truncated ones "
        "included; p_t from TRL's temperature-scaled log-probs. Tree: the group's rows are G leaves drawn at random, "
        "each edge trained once in the first row holding it (officially every kept edge through a replay buffer, "
        "not ported); row 0 is TRL's own sample and the tree's first path.",
        variants=("weight", "max_cutpoints", "max_nodes"),
    )
    claim_metric = ("cutpoints", "cut points per rollout (segments - 1)")
    reconstructed = (
        "weight (mix with TRL's advantages) and max_cutpoints are our options",
        "high-probability tokens get advantage 0 rather than leaving the loss",
        "tree: the G rows are leaves drawn uniformly without replacement (again when the tree has fewer than G); a "
        "shared edge is trained in the first row holding it only",
        "tree: max_nodes (a node budget) is ours; row 0 is TRL's sample and the tree's first path",
        "tree: the official replay buffer of edges (8 iterations, 32 edges per prompt) is not ported",
    )

    def __init__(self, options=None):
        super().__init__(options)
        self._pending = False  # tree: the prompt stage deferred rows 1 .. G-1 of this step's groups

    def hook_enabled(self, hook: str) -> bool:
        if self.options.weight <= 0:
            return False
        if hook == "trl_plugins_generation_prompts":
            return self.options.mode == "tree"
        return True

    @hookimpl
    def trl_plugins_configure(self, trainer, args):
        o = self.options
        if samples_outside_hf_generate(args):
            raise IncompatiblePluginsError(f"spo cannot run with use_vllm=True or continuous batching: {VLLM_BRANCHING}")
        if o.mode != "tree":
            return
        G = args.num_generations
        if o.max_leaves < G:
            raise PluginConfigError(
                f"Option 'branch_factors' of plugin 'spo' got {o.branch_factors}: a tree of at most {o.max_leaves} "
                f"leaves cannot fill a group of num_generations={G}; allowed: branching factors whose product is >= "
                f"{G} (official 6-6-6: 216 leaves).")
        if o.max_nodes is not None and o.max_nodes < G:
            raise PluginConfigError(
                f"Option 'max_nodes' of plugin 'spo' got {o.max_nodes}, smaller than the group (num_generations={G}); "
                f"allowed: None or at least {max(G, len(o.branch_factors))} (one leaf per row needs G nodes).")

    # ----------------------------------------------------------------------------------------- sampling stage
    @hookimpl
    def trl_plugins_generation_prompts(self, ctx: PromptContext):
        """Tree: defer rows 1 .. G-1 of every group; TRL samples row 0, the tree's first path."""
        ctx.defer_slots(lambda k: k != 0)
        self._pending = True  # on every process, whatever its rows: the next hook's collectives run everywhere

    @hookimpl
    def trl_plugins_after_generation(self, ctx: RolloutContext):
        if self.options.mode == "tree":
            if self._pending:  # not in a refill round: its rows were sampled independently and keep TRL's advantage
                self._pending = False
                self._grow_trees(ctx)
            return
        o = self.options
        logps = ctx.policy_logprobs(ctx.prompt_ids, ctx.completion_ids)  # collective: every process, every batch
        limit = ctx.run.max_completion_length
        plan, prompts, prefixes, room = [], [], [], []
        for i, lp in enumerate(logps):
            probs = lp.float().exp()
            cuts = [c for c in cut_points(probs, o.prob_threshold, o.cutpoint_interval, o.max_cutpoints)
                    if c + 1 < limit]
            plan.append(cuts)
            ctx.annotations[i][LOW_KEY] = torch.nonzero(probs < o.prob_threshold).flatten().tolist()
            ctx.annotations[i][LENGTH_KEY] = len(ctx.completion_ids[i])
            for c in cuts:
                prompts += [list(ctx.prompt_ids[i])] * o.mc_samples
                prefixes += [list(ctx.completion_ids[i][: c + 1])] * o.mc_samples
                room += [limit - (c + 1)] * o.mc_samples
        # one call on every process, with no request too: generation and the forward are collectives
        continuations = ctx.continue_prefixes(prompts, prefixes, room)
        rows = [i for i, cuts in enumerate(plan) for _ in range(len(cuts) * o.mc_samples)]
        texts = [ctx.decode(c.completion_ids, i) for c, i in zip(continuations, rows)]
        scores = ctx.score(rows, texts).float() if rows else torch.zeros(0)
        k = 0
        for i, cuts in enumerate(plan):
            values = []
            for _ in cuts:
                values.append(float(scores[k : k + o.mc_samples].mean()))
                k += o.mc_samples
            ctx.annotations[i][CUTS_KEY] = [[c, v] for c, v in zip(cuts, values)]
        ctx.log_metric("extra_rollouts", len(prefixes))
        ctx.log_metric("cutpoints", sum(len(c) for c in plan) / max(len(plan), 1))

    def _grow_trees(self, ctx: RolloutContext) -> None:
        """SPO-tree: grow one tree per group on the process holding its row 0, fill every row with a leaf's path and
        annotate its segments (collective: one seam call per depth, one scoring, one gather, one forward, on every
        process)."""
        o, G, B = self.options, ctx.num_generations, len(ctx)
        limit, D, M = ctx.run.max_completion_length, len(o.branch_factors), o.segment_tokens
        trees = {i: SegmentTree() for i in range(B) if ctx.index_in_group[i] == 0}
        on_trl = {i: (0 if ctx.completion_ids[i] else None) for i in trees}  # the node TRL's row 0 continues
        seam_tokens = seam_requests = 0
        for d in range(D):
            last = d == D - 1
            asked, prompts, prefixes, room = [], [], [], []
            for i, tree in trees.items():
                todo = [n for n in range(len(tree.parent)) if tree.depth[n] == d and not tree.leaf[n]]
                used = len(tree.parent) - 1
                counts = budget_children([o.branch_factors[d]] * len(todo),
                                         None if o.max_nodes is None else o.max_nodes - used, D - d)
                for n, count in zip(todo, counts):
                    if on_trl[i] == n:  # TRL's row 0 holds one child of this node already
                        count -= 1
                        on_trl[i] = self._trl_child(tree, n, ctx.completion_ids[i], M, last)
                    start = len(tree.path[n])
                    for _ in range(count):
                        asked.append((i, n))
                        prompts.append(list(ctx.prompt_ids[i]))
                        prefixes.append(tree.path[n])
                        room.append(limit - start if last else min(M, limit - start))
            conts = ctx.continue_prefixes(prompts, prefixes, room)  # collective: every depth, every process
            seam_requests += len(asked)
            for (i, n), c in zip(asked, conts):
                trees[i].add(n, list(c.completion_ids), c.finished or last or len(c.completion_ids) >= limit)
                seam_tokens += len(c.new_ids)
        where = [(i, n) for i, tree in trees.items() for n in tree.leaves]
        texts = [ctx.decode(trees[i].path[n], i) for i, n in where]
        scores = ctx.score([i for i, _ in where], texts).float().cpu().tolist()  # every process, possibly no row
        for (i, n), s in zip(where, scores):
            trees[i].reward[n] = float(s)
        payload: list[list[float]] = [[] for _ in range(B)]
        stats = {"nodes": 0, "leaves": 0, "kept": 0}
        for i, tree in trees.items():
            values = tree_values(tree)
            adv, kept = edge_advantages(tree, values, o.tree_advantage)
            chosen = choose_leaves(tree.leaves, G, random.Random(ctx.step * 1_000_003 + ctx.group_ids[i]))
            for leaf, segs in zip(chosen, row_segments(tree, chosen, adv, kept)):
                ids = tree.path[leaf]
                payload[i] += [float(len(ids)), *map(float, ids), float(len(segs)), *[x for s in segs for x in s]]
            stats["nodes"] += len(tree.parent) - 1
            stats["leaves"] += len(tree.leaves)
            stats["kept"] += sum(kept)
        width = max([len(p) for p in payload] + [1])
        local = torch.zeros(B, width, dtype=torch.float64)
        for i, p in enumerate(payload):
            local[i, : len(p)] = torch.tensor(p, dtype=torch.float64)
        gathered = ctx.gather_padded(local.to(context_device(ctx)), dim=1).cpu()  # (N, W) collective
        segments = 0
        for j in range(B):
            row0 = ctx.global_index[j] - ctx.index_in_group[j]
            ids, segs = _parse_slot(gathered[row0].tolist(), ctx.index_in_group[j])
            if ids != list(ctx.completion_ids[j]) or (ctx.deferred and ctx.deferred[j]):
                ctx.replace_row(j, ids)
            ctx.annotations[j][SEGMENTS_KEY] = segs
            ctx.annotations[j][LENGTH_KEY] = len(ids)
            segments += len(segs)
        logps = ctx.policy_logprobs(ctx.prompt_ids, ctx.completion_ids)  # collective: every process
        for j, lp in enumerate(logps):
            ctx.annotations[j][LOW_KEY] = torch.nonzero(lp.float().exp() < o.prob_threshold).flatten().tolist()
        n_trees = max(len(trees), 1)
        generated = seam_tokens + sum(len(ctx.completion_ids[i]) for i in trees)
        ctx.log_metric("extra_rollouts", seam_requests)
        ctx.log_metric("cutpoints", (segments - B) / max(B, 1))
        ctx.log_metric("tree_nodes", stats["nodes"] / n_trees)
        ctx.log_metric("tree_leaves", stats["leaves"] / n_trees)
        ctx.log_metric("kept_edges", stats["kept"] / n_trees)
        ctx.log_metric("generated_tokens", float(generated))

    @staticmethod
    def _trl_child(tree: SegmentTree, n: int, ids: list[int], M: int, last: bool) -> int | None:
        """Add node ``n``'s child from TRL's row 0 (the next ``M`` tokens, or the rest at the last depth or when
        fewer remain); returns it when it is expanded further, else None."""
        start = len(tree.path[n])
        end = len(ids) if last or len(ids) <= start + M else start + M
        child = tree.add(n, ids[:end], end == len(ids))
        return None if end == len(ids) else child

    # ----------------------------------------------------------------------------------------- advantage stage
    @hookimpl
    def trl_plugins_transform_advantages(self, ctx: AdvantageContext):
        o = self.options
        if ctx.mode != "train":
            return
        mask = ctx.completion_mask().bool().cpu()  # (N, T_max)
        N, width = mask.shape
        spo = torch.zeros(N, width)
        low = torch.zeros(N, width, dtype=torch.bool)  # the tokens trained: low probability (tree: a trained edge)
        has = torch.zeros(N, dtype=torch.bool)
        rewards = ctx.rewards.float().cpu().nan_to_num(0.0)
        for n, note in enumerate(ctx.annotations):
            if (CUTS_KEY not in note and SEGMENTS_KEY not in note) or note[LENGTH_KEY] > width:
                continue  # e.g. a row of a refill round: it keeps TRL's advantage
            length = note[LENGTH_KEY]
            row_low = torch.zeros(length, dtype=torch.bool)
            row_low[[t for t in note[LOW_KEY] if t < length]] = True
            if SEGMENTS_KEY in note:
                row_adv, on_edge = tree_token_advantages(length, note[SEGMENTS_KEY])
                row_low &= on_edge
                spo[n, :length] = row_adv * row_low.float()
            else:
                cuts = [int(c) for c, _ in note[CUTS_KEY]]
                values = [float(v) for _, v in note[CUTS_KEY]]
                spo[n, :length] = segment_advantages(length, cuts, values, float(rewards[n]), row_low)
            low[n, :length] = row_low
            has[n] = True
        trained = low & mask & has.unsqueeze(1)
        if o.whiten:
            spo = whiten_over(spo, trained) * trained.float()
        base = ctx.advantages.float().cpu()
        if base.dim() == 1:
            base = base.unsqueeze(1).expand(-1, width)
        base = base[:, :width]
        mixed = torch.where(has.unsqueeze(1), (1 - o.weight) * base + o.weight * spo[:, : base.size(1)], base)
        ctx.advantages = mixed.to(ctx.advantages.device, ctx.advantages.dtype)
        ctx.log_metric("trained_token_fraction", float(trained.sum()) / max(float((mask & has.unsqueeze(1)).sum()), 1))
        ctx.log_metric("segment_advantage_abs_mean",
                       float(spo[trained].abs().mean()) if trained.any() else 0.0)
        ctx.log_metric("rows_without_cutpoints",
                       float(sum(1 for note in ctx.annotations if CUTS_KEY in note and not note[CUTS_KEY])))

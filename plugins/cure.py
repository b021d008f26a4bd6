"""CURE — Critical-token re-concatenation for entropy-collapse prevention (arXiv:2508.11016), stage 1.

CURE keeps exploration alive through sampling rather than through a regulariser: it finds the high-entropy
("critical") tokens of the policy's own rollouts and re-generates from just before them, so every group holds
branches that fork at the most uncertain decision points. Facts from the official code (bytedance/CURE,
``recipe/CURE_First_Stage/dapo_ray_trainer.py``, ``get_critic_key_token_mask`` and ``fit``):

1. ``n1`` responses per prompt are sampled (paper: 4).
2. Per response, the per-token entropies of the current policy are computed and the positions are walked in
   descending entropy. Position 0 is skipped; a position is accepted when its token is not a special token and
   its decoded text, stripped, is longer than one character; the walk stops at ``top_k = 20`` accepted
   positions. One accepted position ``t*`` is drawn uniformly (``t* = 0`` when none was accepted).
3. The branch prompt is the original prompt followed by ``response[:t*]`` (the tokens *before* the critical
   token); ``n2`` continuations are sampled from it (paper: 3), i.e. ``n1 * n2`` branches per prompt.
4. One group of ``n1 + n1 * n2`` rows (4 + 12 = 16) shares the advantage baseline. Branch rows are trained on
   their continuation only: the prefix is part of their prompt. The reward of a branch is computed on its
   continuation (the official reward manager scores the response tokens only).
5. Training: DAPO (TRL's default ``loss_type="dapo"``). Stage 2 of the paper is plain DAPO continued from the
   stage-1 checkpoint (``stage1_steps`` switches the branching off after that many optimizer steps).

Mapping onto TRL: the group size is ``num_generations = G = n1 * (1 + n2)`` (with ``branches_per_response =
n2`` the plugin derives ``n1 = G / (1 + n2)``; G must be divisible by ``1 + n2``). TRL samples all G rows from
the original prompt; rows ``0 .. n1-1`` of each group are the originals and rows ``n1 + k*n2 + j`` are replaced
by branch ``j`` of original ``k`` (the order of the official concatenation). The replaced rows' first samples
are discarded, so CURE costs ``n1*n2`` extra completions per group here (counted in the rollout budget). The
entropies come from a no-grad forward over the originals (``RolloutContext.policy_entropies``); the branch
continuations are sampled by the trainer's generation service from ``prompt + prefix`` token ids, so their
sampling log-probs are valid for their training prompt (no prompt swap). ``selection="random"`` is the official
code's ablation (random positions). ``min_token_chars`` is the official ``> 1`` rule (use 1 for a
character-level tokenizer). With ``branches_per_response = 0`` the plugin does nothing (plain GRPO).

Official code checked against: ``bytedance/CURE@a2a0217`` (faithful with documented options; the files and the deviating
options: ``trl-plugins show cure``, docs/faithfulness.md).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Literal

import torch

from trl_plugins.api import OfficialSource, Plugin, PluginConfigError, PluginOptions, RolloutContext, hookimpl, option
from trl_plugins.api.collectives import gather_id_lists
from trl_plugins.api.contexts import context_device
from trl_plugins.api.reasons import EDITS_COMPLETIONS
from trl_plugins.api.reasons import IMAGES_GENERATION_SERVICE


@dataclass
class CureOptions(PluginOptions):
    branches_per_response: int = option(
        3, min=0,
        help="n2: continuations sampled from each original's critical prefix (paper: 3). The originals per group "
        "are n1 = num_generations / (1 + n2). 0 switches the method off.",
    )
    top_k: int = option(20, min=1, help="Candidate positions per response: the top_k highest-entropy valid ones.")
    selection: Literal["entropy", "random"] = option(
        "entropy", help="'entropy': walk positions by descending entropy (CURE); 'random': random order (ablation)."
    )
    min_token_chars: int = option(
        2, min=0,
        help="A candidate token's decoded text, stripped, needs at least this many characters (official: more "
        "than 1). Use 1 with a character-level tokenizer.",
    )
    stage1_steps: int | None = option(
        None, min=0,
        help="Branch only during the first stage1_steps optimizer steps, then plain GRPO (the paper's stage 2 is "
        "plain DAPO continued from the stage-1 checkpoint). None = branch throughout.",
    )


def group_layout_cure(num_generations: int, branches: int) -> int:
    """Number of originals ``n1 = G / (1 + n2)``; raises when G is not a multiple of ``1 + n2``."""
    if num_generations % (1 + branches) != 0:
        raise PluginConfigError(
            f"cure: num_generations={num_generations} must be a multiple of 1 + branches_per_response "
            f"(= {1 + branches}) so that each group holds n1 originals and n1*{branches} branches; e.g. "
            f"num_generations={(1 + branches) * max(1, num_generations // (1 + branches))}."
        )
    return num_generations // (1 + branches)


def branch_source(index_in_group: int, n1: int, branches: int) -> int | None:
    """Which original (its index in the group) row ``index_in_group`` branches from; None for an original."""
    if index_in_group < n1:
        return None
    return (index_in_group - n1) // branches


def critical_candidates(
    entropies: list[float] | torch.Tensor,
    token_ids: list[int],
    token_texts: list[str],
    special_ids: set[int],
    top_k: int,
    min_chars: int,
    order: list[int] | None = None,
) -> list[int]:
    """The accepted critical positions of one response, in walk order (at most ``top_k``).

    Walks positions by descending entropy (ties: earlier position first), or in ``order`` when given (random
    ablation). Skips position 0, special tokens and tokens whose stripped text is shorter than ``min_chars``.
    """
    n = len(token_ids)
    if order is None:
        values = torch.as_tensor(entropies, dtype=torch.float64)[:n]
        order = torch.argsort(-values, stable=True).tolist()
    accepted: list[int] = []
    for t in order:
        if len(accepted) >= top_k:
            break
        if t == 0 or t >= n:
            continue
        if int(token_ids[t]) in special_ids:
            continue
        if len(token_texts[t].strip()) < min_chars:
            continue
        accepted.append(t)
    return accepted


def row_generator(seed: int, step: int, global_index: int) -> torch.Generator:
    """A generator seeded by (run seed, step, global row), so every process draws the same for a given row."""
    g = torch.Generator()
    g.manual_seed((seed * 1_000_003 + step * 10_007 + global_index) % (2**63 - 1))
    return g


def choose_position(candidates: list[int], generator: torch.Generator) -> int:
    """``t*``: one candidate uniformly at random, or 0 when there is none (official fallback)."""
    if not candidates:
        return 0
    return candidates[int(torch.randint(len(candidates), (1,), generator=generator).item())]


class CurePlugin(Plugin):
    """Branch from high-entropy critical tokens of the originals and re-generate from those prefixes (sampling)."""

    name = "cure"
    image_inputs = IMAGES_GENERATION_SERVICE
    multi_turn = EDITS_COMPLETIONS
    version = "0.1.0"
    paper = "CURE: Critical-Token-Guided Re-Concatenation for Entropy-Collapse Prevention, arXiv:2508.11016"
    summary = "Re-generates part of each group from the prefixes before the originals' high-entropy critical tokens."
    Options = CureOptions
    official = OfficialSource(
        "bytedance/CURE", "a2a0217", verdict="faithful",
        files=("recipe/CURE_First_Stage/dapo_ray_trainer.py",),
    )
    claim_metric = ("critical_token_entropy", "entropy at the critical tokens")
    replaces = ("part of each group's completions (re-generated from critical-token prefixes)",)
    reconstructed = (
        "TRL samples all G rows first; the n1*n2 branch rows replace rows n1.. of the group (their first samples are "
        "discarded), since a TRL group has a fixed size",
        "ties in entropy are broken by position (the official argsort is not stable)",
    )

    @hookimpl
    def trl_plugins_configure(self, trainer, args):
        if self.options.branches_per_response > 0:
            group_layout_cure(trainer.num_generations, self.options.branches_per_response)
        if args.loss_type != "dapo":
            warnings.warn(f"cure: the paper trains with DAPO (loss_type='dapo'); got {args.loss_type!r}.", stacklevel=2)
        self._seed = int(args.seed)

    @hookimpl
    def trl_plugins_after_generation(self, ctx: RolloutContext):
        o = self.options
        n2 = o.branches_per_response
        if n2 == 0 or (o.stage1_steps is not None and ctx.step >= o.stage1_steps):
            return
        G = ctx.num_generations
        n1 = group_layout_cure(G, n2)
        originals = [i for i in range(len(ctx)) if ctx.index_in_group[i] < n1]

        # 1-2. critical position of each local original (entropy forward is collective: every process calls it)
        entropies = ctx.policy_entropies(originals) if o.selection == "entropy" else [None] * len(originals)
        tokenizer = ctx.tokenizer
        special = set(int(t) for t in getattr(tokenizer, "all_special_ids", []) or [])
        positions = [-1] * len(ctx)
        chosen_entropy = []
        seed = getattr(self, "_seed", 0)
        for i, ent in zip(originals, entropies):
            ids = ctx.completion_ids[i]
            gen = row_generator(seed, ctx.step, ctx.global_index[i])
            order = None
            if o.selection == "random":
                order = torch.randperm(len(ids), generator=gen).tolist() if ids else []
            texts = _token_texts(ids, tokenizer)
            cands = critical_candidates(
                ent if ent is not None else [0.0] * len(ids), ids, texts, special, o.top_k, o.min_token_chars, order
            )
            positions[i] = choose_position(cands, gen)
            if ent is not None and cands:
                chosen_entropy.append(float(ent[positions[i]]))
        # 3. every process learns every original's completion and t* (a group may straddle processes)
        all_ids = gather_id_lists(ctx, ctx.completion_ids)
        all_pos = ctx.gather(torch.tensor(positions, dtype=torch.long, device=context_device(ctx))).tolist()

        branch_rows, requests, prefixes = [], [], []
        for i in range(len(ctx)):
            k = branch_source(ctx.index_in_group[i], n1, n2)
            if k is None:
                continue
            source = ctx.group_ids[i] * G + k
            prefix = all_ids[source][: max(all_pos[source], 0)]
            branch_rows.append((i, source))
            prefixes.append(prefix)
            requests.append(list(ctx.prompt_ids[i]) + prefix)
        completions = ctx.service.generate(prompt_ids=requests)  # collective, maybe with no request
        for (i, source), prefix, request, completion in zip(branch_rows, prefixes, requests, completions):
            ctx.replace_row(i, completion.completion_ids, logprobs=completion.logprobs, prompt_swapped=False)
            ctx.prompt_ids[i] = request  # the prefix is part of the branch's training prompt
            ctx.annotations[i]["cure_branch_of"] = source
            ctx.annotations[i]["cure_prefix_tokens"] = len(prefix)

        n_orig = max(len(originals), 1)
        ctx.log_metric("extra_rollouts", len(completions))
        ctx.log_metric("mean_prefix_tokens", sum(map(len, prefixes)) / max(len(prefixes), 1))
        ctx.log_metric("no_candidate_fraction", sum(positions[i] == 0 for i in originals) / n_orig)
        if chosen_entropy:
            ctx.log_metric("critical_token_entropy", sum(chosen_entropy) / len(chosen_entropy))


def _token_texts(ids: list[int], tokenizer: Any) -> list[str]:
    """Decoded text of each token on its own (special tokens kept, as the official check decodes them)."""
    return [tokenizer.decode([int(t)]) for t in ids]

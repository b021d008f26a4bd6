"""REX-RAG — reasoning exploration with policy correction (arXiv:2508.08149, "REX-RAG: Reasoning Exploration with
Policy Correction in Retrieval-Augmented Generation").

A policy that answers wrongly keeps sampling the same dead-end reasoning. REX-RAG adds **probe rollouts**: a failed
trajectory is cut just before its answer, an exploratory probe phrase (a doubt about the reasoning so far, drawn
uniformly from a pool) is appended, and the policy continues from there. The probe tokens were not sampled by the
policy and the probe rows exist only because their source failed, so the batch is sampled from a **mixture**
``mu = (1 - alpha) pi_old + alpha pi_probe``; the policy correction replaces ``pi_old`` by that mixture in the PPO
ratio of every token.

Facts from the official code (``MiliLab/REX-RAG@d9dbbb4``):

* trigger (``search_r1/llm_agent/generation.py:618-690``, ``execute_predictions``): an original rollout that emits an
  ``<answer>...</answer>`` block scoring below full reward is cloned with probability 20% (``randint(0, 100) < 20``,
  ``data.revision_prob=20`` in ``scripts/search-r1-sgl/run_grpo_sglang_fsdp.sh:43``); the clone drops the answer
  block, gets one probe phrase drawn uniformly from a pool of 30 (``search_r1/llm_agent/thinking_prompts.py:67-98``,
  each starting with ``"<think> "``) and continues; the clone shares its source's group (GRPO advantages over the
  originals and the probes together) and its probe tokens are trained (they stay in the loss mask);
* trajectory filter (``verl/trainer/ppo/ray_trainer.py:614-646`` ``reorder_batch``, called at 1529-1530): of the
  clones, only the ``keep_ratio`` (0.08 of the batch, ``run_grpo_sglang_fsdp.sh:94``, then an EWM with alpha 0.1 of
  the probes' accuracy) with the highest mean old log-prob of their probe tokens are kept;
* policy correction (``verl/workers/actor/dp_actor.py:447-497``): ``alpha`` = the fraction of probe rows in the batch,
  ``e`` = 1 - the accuracy of the original rows; per token, the behaviour probability is
  ``(1 - alpha) pi_old + alpha mu`` with ``mu = 0`` on original rows, and on a probe row ``mu = pi_old / e^(1/j)`` on
  its ``j`` prefix tokens (the prefix was kept because it failed), ``mu = q`` on the probe tokens (``q``: the pool's
  next-token frequency given the probe tokens before it, ``verl/workers/actor/exploration_distribution.py:10-49``),
  ``mu = pi_old`` on the continuation. The ratio ``pi_theta / mixture`` then enters PPO's clipped surrogate.

Mapping onto TRL (single-turn text). A group keeps G rows: its last ``probe_slots`` rows are **probe slots**, left out
of TRL's generation round (``PromptContext.defer``). After generation every sampled rollout is scored
(``ctx.success``, the run's verifier column); a failed one whose text holds an ``answer_pattern`` match is a probe
candidate with probability ``probe_prob``, gets its probe phrase (seeded by step and row) and a score, the policy's
mean log-prob of the probe tokens after the cut prefix (the official filter's score). The k-th probe slot of a group
takes the group's k-th best candidate and continues ``prefix + probe`` through the branching seam
(``ctx.continue_prefixes``: HF generate, one collective call per step, counted in the rollout budget); a slot with no
candidate left holds an ordinary policy rollout (a continuation of the empty prefix). The probe tokens are marked
off-policy. The advantage stage derives ``alpha`` and ``e`` over the whole generation batch and attaches per-token
mixture factors; the loss replaces the surrogate of every completion token by the clipped surrogate on
``r = pi_theta / mixture`` (``replaces_surrogate``). With no probe row in the batch the mixture is ``pi_old`` and the
loss is TRL's.

Retrieval is the run's own business: the official runs interleave Search-R1 search calls (multi-turn, a retriever
server); here the reward functions and the prompt (e.g. retrieved passages in it) are the run's setup, and tool
rollouts are refused while ``probe_slots > 0`` because the branching seam continues single-turn text without
running tools.

Deviations, documented: the probe pool is ours (20 phrases in our own words, same intent); the official group grows
by its clones while ours keeps G rows (probe slots filled by plain rollouts when no candidate exists); the official
filter keeps the batch's best ``keep_ratio`` clones with an adaptive ratio, ours keeps the best ``probe_slots`` per
group; success is the run's success rule (the official: reward below 1 fails). Neutral setting ``probe_slots=0``:
no hook runs, the run is TRL's.
"""

from __future__ import annotations

import bisect
import math
import random
import re
import warnings
from dataclasses import dataclass

import torch

from trl_plugins.api import (
    AdvantageContext,
    IncompatiblePluginsError,
    LossContext,
    OfficialSource,
    Plugin,
    PluginConfigError,
    PromptContext,
    RolloutContext,
    hookimpl,
    option,
)
from trl_plugins.api.collectives import context_device, gather_id_lists
from trl_plugins.api.loss_types import CLIPPED_LOSS_TYPES
from trl_plugins.api.reasons import IMAGES_GENERATION_SERVICE, VLLM_BRANCHING, samples_outside_hf_generate
from trl_plugins.api.success import SuccessOptions

#: Annotation of a probe row: ``{"start": j, "length": P, "source": index in group, "phrase": pool index}``.
PROBE_KEY = "rex_rag_probe"
#: Annotation of a probe row: ``q`` of each probe token (the pool's next-token frequency).
PROBE_Q_KEY = "rex_rag_probe_q"
#: Per-token mixture factors riding to the loss: behaviour prob = SCALE * pi_old + SHIFT.
SCALE_EXTRA = "rex_rag_mix_scale"
SHIFT_EXTRA = "rex_rag_mix_shift"

#: Our probe pool (the official one holds 30 phrases; these say the same thing in our own words).
DEFAULT_PROBES = (
    "Wait, let me reconsider whether I missed a key fact.",
    "Hold on, part of my reasoning may be wrong.",
    "Let me step back: something in my argument might not hold.",
    "I should double-check the facts I relied on.",
    "Maybe I skipped an important detail; let me look again.",
    "On second thought, my earlier step could be mistaken.",
    "Let me question the assumption I just made.",
    "I am not sure this is right; let me re-examine it.",
    "There may be a gap in my reasoning that I should fill.",
    "Let me verify each step before answering.",
    "Perhaps I misread the question; let me check it again.",
    "Something does not add up; let me retrace my steps.",
    "I might have trusted the wrong piece of information.",
    "Let me look for evidence I overlooked.",
    "Before answering, let me test my conclusion once more.",
    "My previous line of thought may have gone astray.",
    "Let me reconsider the problem from a different angle.",
    "I could have drawn a hasty conclusion; let me recheck.",
    "Let me make sure no step of my reasoning is flawed.",
    "It is possible I overlooked a crucial clue; let me think again.",
)


@dataclass
class RexRagOptions(SuccessOptions):
    probe_slots: int = option(
        1, min=0, help="Rows of each group (its last ones) reserved for probe rollouts; 0 = off (plain GRPO). The "
        "official run adds about 0.08 x the batch in clones (0.4 per group of 5); a fixed slot is our mapping.",
        reconstructed=True,
    )
    probe_prob: float = option(
        0.2, min=0.0, max=1.0, help="Probability that a failed, answered rollout becomes a probe candidate (official "
        "revision_prob=20: randint(0, 100) < 20).",
    )
    probes: list[str] = option(
        default_factory=lambda: list(DEFAULT_PROBES), help="Pool of probe phrases, drawn uniformly (ours, in our own words; the official pool "
        "holds 30 doubts about the previous reasoning).",
    )
    probe_prefix: str = option(
        "<think> ", help="Text put before every probe phrase (official: each probe starts with '<think> ').",
    )
    answer_pattern: str = option(
        r"<answer>.*?</answer>", help="Regular expression (DOTALL) of the answer; a failed rollout is cut just before "
        "its first match (official Search-R1 format). A rollout without a match is no probe candidate.",
    )

    def validate(self) -> None:
        if not self.probes or any(not isinstance(p, str) or not p.strip() for p in self.probes):
            raise PluginConfigError(
                f"Option 'probes' of plugin 'rex_rag' got {self.probes!r}; allowed: a non-empty list of non-blank "
                "phrases.")
        try:
            compiled = re.compile(self.answer_pattern, re.DOTALL)
        except re.error as exc:
            raise PluginConfigError(
                f"Option 'answer_pattern' of plugin 'rex_rag' got {self.answer_pattern!r}, not a regular expression "
                f"({exc}); allowed: a Python regular expression matching the answer.") from exc
        if compiled.search("") is not None:
            raise PluginConfigError(
                f"Option 'answer_pattern' of plugin 'rex_rag' got {self.answer_pattern!r}, which matches the empty "
                "text; allowed: a pattern that needs at least one character (the answer).")

    def probe_texts(self) -> list[str]:
        return [self.probe_prefix + p for p in self.probes]


# ============================================================================================= pure functions
def answer_cut(ids: list[int], decode, pattern: re.Pattern) -> int | None:
    """Number of leading tokens of ``ids`` whose text ends at or before the first ``pattern`` match (the answer), or
    None when the text holds no match. ``decode(ids) -> str``."""
    text = decode(ids)
    match = pattern.search(text)
    if match is None:
        return None
    lengths = _Lengths(ids, decode)
    return bisect.bisect_right(lengths, match.start()) - 1


class _Lengths:
    """Lazy sequence ``len(decode(ids[:t]))`` for t = 0 .. len(ids) (non-decreasing), for :func:`bisect`."""

    def __init__(self, ids, decode):
        self.ids, self.decode = ids, decode

    def __len__(self):
        return len(self.ids) + 1

    def __getitem__(self, t):
        return len(self.decode(self.ids[:t])) if t else 0


def probe_token_probs(pool_ids: list[list[int]], probe_ids: list[int]) -> list[float]:
    """``q`` of each probe token: among the pool's phrases (token ids) sharing the probe's first ``k`` tokens, the
    fraction that continue with its token ``k`` (the uniform draw over the pool as a token-level distribution; the
    official prefix index). (P,) floats; 1.0 where every phrase agrees."""
    out = []
    for k in range(len(probe_ids)):
        head = [p for p in pool_ids if p[:k] == probe_ids[:k]]
        hits = sum(1 for p in head if len(p) > k and p[k] == probe_ids[k])
        out.append(hits / len(head) if head else 1.0)
    return out


def mixture_factors(length: int, alpha: float, error_rate: float, probe: tuple[int, list[float]] | None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token factors ``(scale, shift)`` of one row, the behaviour probability being ``scale pi_old + shift``.

    Original row: ``scale = 1 - alpha``. Probe row with prefix length ``j`` and probe-token probabilities ``q``
    (``probe = (j, q)``): prefix ``1 - alpha + alpha e^(-1/j)``; probe tokens ``1 - alpha`` and ``shift = alpha q``;
    continuation ``1``. Returns two (length,) float32 tensors.
    """
    scale = torch.full((length,), 1.0 - alpha)
    shift = torch.zeros(length)
    if probe is not None:
        j, q = probe
        if j > 0:
            scale[:j] = 1.0 - alpha + alpha * max(error_rate, 1e-12) ** (-1.0 / j)
        end = min(j + len(q), length)
        shift[j:end] = alpha * torch.tensor(q[: end - j], dtype=torch.float32)
        scale[end:] = 1.0
    return scale, shift


def mixture_logps(old_logps: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """``log(scale exp(old) + shift)`` (B, T), stable for small probabilities (``shift = 0`` gives
    ``old + log scale``)."""
    return torch.logaddexp(old_logps + torch.log(scale), torch.log(shift))


def corrected_surrogate(per_token_logps: torch.Tensor, behaviour_logps: torch.Tensor, advantages: torch.Tensor,
                        low: torch.Tensor | float, high: torch.Tensor | float) -> torch.Tensor:
    """PPO's clipped surrogate ``-min(r A, clip(r, low, high) A)`` with ``r = exp(lp - log mixture)`` (B, T)."""
    ratio = torch.exp(per_token_logps - behaviour_logps)
    clipped = torch.minimum(torch.maximum(ratio, torch.as_tensor(low, dtype=ratio.dtype, device=ratio.device)),
                            torch.as_tensor(high, dtype=ratio.dtype, device=ratio.device))
    return -torch.minimum(ratio * advantages, clipped * advantages)


def _draw(step: int, global_index: int, pool: int) -> tuple[float, int]:
    """The candidate draw and the phrase index of a rollout, the same on every process (seeded by step and row)."""
    rnd = random.Random(f"rex_rag:{step}:{global_index}")
    return rnd.random(), rnd.randrange(pool)


# ============================================================================================= plugin
class RexRagPlugin(Plugin):
    """Probe rollouts continue failed trajectories after an exploratory phrase; the loss corrects for the mixture."""

    name = "rex_rag"
    version = "0.1.0"
    paper = "REX-RAG: Reasoning Exploration with Policy Correction in Retrieval-Augmented Generation, arXiv:2508.08149"
    summary = "Probe rollouts (failed trajectory + exploratory phrase, continued) with a mixture-policy IS correction."
    Options = RexRagOptions
    image_inputs = True
    multi_turn = True
    official = OfficialSource(
        "MiliLab/REX-RAG", "d9dbbb4", verdict="faithful",
        files=("search_r1/llm_agent/generation.py", "verl/workers/actor/dp_actor.py",
               "verl/trainer/ppo/ray_trainer.py", "verl/workers/actor/exploration_distribution.py"),
        note="Single-turn mapping of the multi-turn Search-R1 recipe: probe slots inside a fixed group of G instead of "
        "clones growing the group; per-group top-k filter instead of the batch's adaptive keep ratio; our own "
        "probe pool.",
    )
    claim_metric = ("probe_success_rate", "probe rollouts that pass the verifier (official Acc/revision)")
    replaces_surrogate = True
    loss_types = CLIPPED_LOSS_TYPES
    loss_types_reason = "the policy correction puts the mixture ratio into PPO's clipped surrogate."
    replaces = (
        "the last probe_slots completions of each group (probe rollouts, probe tokens off-policy)",
        "the base surrogate on every completion token (the ratio over the mixture behaviour policy)",
    )
    reconstructed = (
        "probe slots inside a group of fixed size G (the official clones join the group as extra rows)",
        "a probe slot without a candidate holds an ordinary policy rollout",
        "the filter keeps each group's best probe_slots candidates (official: the batch's best keep_ratio clones)",
        "the probe pool is ours (same intent as the official 30 phrases)",
    )

    def __init__(self, options=None):
        super().__init__(options)
        self._pending = False
        self._pool_ids: list[list[int]] | None = None

    # ----------------------------------------------------------------------------------------- checks
    def hook_enabled(self, hook: str) -> bool:
        return self.options.probe_slots > 0 or hook == "trl_plugins_configure"

    def image_inputs_refusal(self) -> str | None:
        if self.options.probe_slots > 0:
            return f"with probe_slots={self.options.probe_slots}, {IMAGES_GENERATION_SERVICE}"
        return None

    def multi_turn_refusal(self) -> str | None:
        if self.options.probe_slots > 0:
            return ("probe rollouts continue through the branching seam, which samples single-turn text without "
                    "running tools (the official search calls are not replayed); set probe_slots=0 for tool rollouts.")
        return None

    @hookimpl
    def trl_plugins_configure(self, trainer, args):
        o = self.options
        if o.probe_slots == 0:
            return
        if samples_outside_hf_generate(args):
            raise IncompatiblePluginsError(
                f"rex_rag with probe_slots={o.probe_slots} cannot run with use_vllm=True or continuous batching: "
                f"{VLLM_BRANCHING} Or set probe_slots=0.")
        G = args.num_generations
        if o.probe_slots >= G:
            raise PluginConfigError(
                f"Option 'probe_slots' of plugin 'rex_rag' got {o.probe_slots}; allowed: 0 to {G - 1} "
                f"(num_generations={G}: a probe continues a failed rollout of its own group).")
        if getattr(args, "importance_sampling_level", "token") != "token":
            raise PluginConfigError(
                f"rex_rag: importance_sampling_level={args.importance_sampling_level!r}; allowed: 'token' (the "
                "correction is per token).")
        if getattr(args, "delta", None) is not None:
            raise PluginConfigError(
                f"rex_rag: delta={args.delta!r}; allowed: None (two-sided clipping is not part of the corrected "
                "surrogate).")
        eps_high = getattr(args, "epsilon_high", None) or getattr(args, "epsilon", 0.2)
        if o.probe_slots / G > eps_high / (1 + eps_high):
            warnings.warn(
                f"rex_rag: probe_slots={o.probe_slots} of num_generations={G} lets the probe fraction alpha reach "
                f"{o.probe_slots / G:.2f}; the correction divides pi_old by 1 - alpha on original rows, so above "
                f"{eps_high / (1 + eps_high):.2f} their ratio starts beyond 1 + epsilon_high and positive-advantage "
                "tokens are clipped (the official runs keep alpha near 0.08). Fewer slots or a larger group avoid it.",
                stacklevel=2)
        tokenizer = getattr(trainer, "processing_class", None)
        tokenizer = getattr(tokenizer, "tokenizer", tokenizer)
        if tokenizer is not None:
            self._pool_ids = self._tokenize_pool(tokenizer)

    def _tokenize_pool(self, tokenizer) -> list[list[int]]:
        return [list(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in self.options.probe_texts()]

    # ----------------------------------------------------------------------------------------- sampling
    @hookimpl
    def trl_plugins_generation_prompts(self, ctx: PromptContext):
        """Defer the probe slots (the last probe_slots rows of each group)."""
        first = ctx.num_generations - self.options.probe_slots
        ctx.defer_slots(lambda k: k >= first)
        self._pending = True  # on every process: the next hook's collectives run everywhere

    @hookimpl
    def trl_plugins_after_generation(self, ctx: RolloutContext):
        """Pick the probe candidates, score them, fill each probe slot (collective: one forward, four gathers and
        one branching call on every process)."""
        if not self._pending:
            return
        self._pending = False
        o, G, B = self.options, ctx.num_generations, len(ctx)
        first, limit = G - o.probe_slots, ctx.run.max_completion_length
        pool = self._pool_ids if self._pool_ids is not None else self._tokenize_pool(ctx.tokenizer)
        pattern = re.compile(o.answer_pattern, re.DOTALL)
        decode = lambda ids: ctx.tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
        sampled = [i for i in range(B) if ctx.index_in_group[i] < first]
        failed = ~ctx.success(sampled, rule=o.success_rule) if sampled else torch.zeros(0, dtype=torch.bool)
        info = torch.full((B, 3), float("nan"))  # score, cut, phrase
        cands, requests = [], []
        for i, bad in zip(sampled, failed.tolist()):
            u, phrase = _draw(ctx.step, ctx.global_index[i], len(pool))
            if not bad or u >= o.probe_prob:
                continue
            cut = answer_cut(list(ctx.completion_ids[i]), decode, pattern)
            if cut is None or cut + len(pool[phrase]) >= limit:
                continue
            cands.append(i)
            info[i, 1:] = torch.tensor([float(cut), float(phrase)])
            requests.append(list(ctx.completion_ids[i][:cut]) + pool[phrase])
        logps = ctx.policy_logprobs([ctx.prompt_ids[i] for i in cands], requests)  # collective, even with no row
        for i, lp in zip(cands, logps):
            P = len(pool[int(info[i, 2])])
            info[i, 0] = float(lp[-P:].float().mean())
        info = ctx.gather(info.to(context_device(ctx))).cpu()
        cand_set = set(cands)
        ids = gather_id_lists(ctx, [ctx.completion_ids[i] if i in cand_set else [] for i in range(B)])
        slots, prompts, prefixes, room, plans = [], [], [], [], []
        for i in range(B):
            k = ctx.index_in_group[i] - first
            if k < 0:
                continue
            base = ctx.group_ids[i] * G
            ranked = sorted((s for s in range(base, base + first) if math.isfinite(float(info[s, 0]))),
                            key=lambda s: (-float(info[s, 0]), s))
            slots.append(i)
            prompts.append(list(ctx.prompt_ids[i]))
            if k < len(ranked):
                s = ranked[k]
                cut, phrase = int(info[s, 1]), int(info[s, 2])
                prefix = ids[s][:cut] + pool[phrase]
                plans.append((s - base, cut, phrase))
            else:
                prefix = []
                plans.append(None)
            prefixes.append(prefix)
            room.append(limit - len(prefix))
        continuations = ctx.continue_prefixes(prompts, prefixes, room)  # collective, even with no request
        probes = []
        for i, c, plan in zip(slots, continuations, plans):
            t = len(c.completion_ids) - len(c.new_ids)
            lps = None if ctx.sampling_logprobs is None else [float("nan")] * t + list(c.logprobs)
            if plan is None:
                ctx.replace_row(i, c.completion_ids, logprobs=lps)
                continue
            source, cut, phrase = plan
            P = len(pool[phrase])
            flags = [False] * cut + [True] * P + [False] * (len(c.completion_ids) - cut - P)
            ctx.replace_row(i, c.completion_ids, offpolicy=flags, logprobs=lps)
            ctx.annotations[i][PROBE_KEY] = {"start": cut, "length": P, "source": source, "phrase": phrase}
            ctx.annotations[i][PROBE_Q_KEY] = probe_token_probs(pool, pool[phrase])
            probes.append(i)
        passed = float(ctx.success(probes, rule=o.success_rule).sum()) if probes else 0.0
        counts = ctx.gather(torch.tensor([[float(len(cands)), float(len(probes)), passed]],
                                         device=context_device(ctx))).sum(0).tolist()
        ctx.log_metric("probe_candidates", counts[0])
        ctx.log_metric("probe_rollouts", counts[1])
        if counts[1]:
            ctx.log_metric("probe_success_rate", counts[2] / counts[1])

    # ----------------------------------------------------------------------------------------- correction
    @hookimpl
    def trl_plugins_transform_advantages(self, ctx: AdvantageContext):
        """Attach the per-token mixture factors of this process's rows (``alpha`` and ``e`` over the whole batch)."""
        if ctx.mode != "train" or ctx.local_completion_ids is None:
            return
        is_probe = [PROBE_KEY in a for a in ctx.annotations]
        n_probe = sum(is_probe)
        alpha = n_probe / max(len(is_probe), 1)
        originals = torch.tensor([not p for p in is_probe])
        ok = ctx.success(self.options.success_rule).cpu()
        error_rate = 1.0 - float(ok[originals].float().mean()) if bool(originals.any()) else 1.0
        width = ctx.local_completion_ids.size(1)
        rows = range(len(ctx.annotations))[ctx.process_slice]
        scales, shifts = [], []
        for g in rows:
            note = ctx.annotations[g].get(PROBE_KEY)
            probe = None if note is None else (note["start"], list(ctx.annotations[g][PROBE_Q_KEY]))
            scale, shift = mixture_factors(width, alpha, error_rate, probe)
            scales.append(scale)
            shifts.append(shift)
        device = ctx.local_completion_ids.device
        ctx.set_local_extra(SCALE_EXTRA, torch.stack(scales).to(device) if scales else torch.ones(0, width))
        ctx.set_local_extra(SHIFT_EXTRA, torch.stack(shifts).to(device) if shifts else torch.zeros(0, width))
        ctx.log_metric("mixture_alpha", alpha)
        ctx.log_metric("error_rate", error_rate)

    @hookimpl
    def trl_plugins_loss(self, ctx: LossContext):
        scale, shift = ctx.extras.get(SCALE_EXTRA), ctx.extras.get(SHIFT_EXTRA)
        if scale is None or shift is None:
            return  # evaluation, or a batch the advantage stage did not see
        T = ctx.per_token_logps.size(1)
        scale, shift = scale[:, :T].to(ctx.per_token_logps.dtype), shift[:, :T].to(ctx.per_token_logps.dtype)
        if bool((scale == 1).all()) and bool((shift == 0).all()):
            return  # no probe row in the batch: the mixture is pi_old, TRL's surrogate stands
        behaviour = mixture_logps(ctx.old_per_token_logps.detach(), scale, shift)
        low, high = 1 - ctx.epsilon_low, 1 + ctx.epsilon_high
        if ctx.clip_scale is not None:
            low, high = 1 - ctx.clip_scale * ctx.epsilon_low, 1 + ctx.clip_scale * ctx.epsilon_high
        values = corrected_surrogate(ctx.per_token_logps, behaviour, ctx.advantages, low, high)
        mask = ctx.mask.bool()
        ctx.replace_tokens(mask, values)
        ratio = torch.exp(ctx.per_token_logps.detach() - behaviour)
        ctx.log_metric("corrected_ratio_mean", ctx.global_masked_mean(ratio, mask.float()))

"""SCOPE — Step-wise Correction for On-Policy Exploration (arXiv:2602.24110, "Recycling Failures: Salvaging
Exploration in RLVR via Fine-Grained Off-Policy Guidance").

Outcome rewards punish a "mostly right, one slip" rollout as hard as nonsense. SCOPE salvages such failures: a
process reward model (PRM) finds the **first wrong step** of a failed rollout, the policy's own verified prefix is
kept **token for token**, and only the rest is rectified off-policy. The repaired rollout replaces the failed one in
its group (G never changes); its prefix stays on-policy, its corrected tokens are trained through the shaped
off-policy branch ``-A p/(p+gamma)`` (LUFFY, gamma = 0.1) and get NaN sampling log-probs (no vLLM IS correction).

Per generation batch::

    r_i      = verifier value of rollout i (success_column: the first non-placeholder reward function by default)
    failed   = {i : not r_i > success_threshold} in the selected groups (scope_groups); other columns never count
    s_i      = PRM step scores of rollout i;  k_i = min{k : s_i[k] < threshold}  (0-based)
    prefix_i = the completion's token ids up to the start of step k_i (no re-tokenization)
    y'_i     = prefix_i + correction            (mode, below)
    accept   = verifier(y'_i) > success_threshold (accept="correct_only")
    per group: at most max_per_group accepted repairs, the longest verified prefix (largest k_i) first

Modes (who writes the correction): ``teacher_suffix`` -- a teacher LLM continues from the prefix to the end;
``teacher_step`` -- the teacher writes only step ``k_i``, then the **policy** continues on-policy (through the
trainer's generation service, one collective call per batch; those tokens keep their sampling log-probs);
``reference_suffix`` -- the dataset's reference solution from its step ``k_i`` on (no teacher model).

What the paper states is only the skeleton (PRM -> first error -> step-wise off-policy rectification of failed
rollouts). Every other choice is a **reconstruction**, exposed as an option with our default and marked
``reconstructed``: who corrects (teacher endpoint), rectification mode, PRM (Qwen2.5-Math-PRM-7B) and
threshold (0.5), step separator (the PRM's convention), which groups (all), no-error policy (skip), minimum
verified prefix (1 step: k* = 1 is skipped), acceptance rule (correct only), repairs per group (1, longest prefix,
random tie-break), gamma (0.1). The recommended advantage (``A = r - mean``: ``scale_rewards="none"``)
and aggregation (``loss_type="dr_grpo"``) are GRPOConfig settings, left to the user. VPPO (arXiv:2601.18984) uses
the same first-error localisation for credit only; that ablation is the PRM part of this plugin without a repair.

The PRM and teacher are real components (:mod:`trl_plugins.components.prm`, :mod:`trl_plugins.components.teacher`)
built once per configuration and shared with other plugins asking for the same one (Posterior-GRPO rewards the
process of successes with the same PRM). Metrics: ``rectified_fraction`` (rows replaced / N), ``acceptance_rate``
(accepted repairs / repairs tried), ``candidate_fraction``, ``prm_no_error_fraction``, ``mean_prefix_steps``,
``prefix_token_fraction``, and ``fallback_prm_found_no_error`` (1.0 in a batch where the PRM found no error in any
failed rollout, so every repair was skipped; warned once).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, Literal

import torch

from trl_plugins.api import (
    OfficialSource,
    Plugin,
    PluginConfigError,
    RolloutContext,
    hookimpl,
    option,
)
from trl_plugins.api.collectives import run_together
from trl_plugins.api.contexts import context_device
from trl_plugins.api.option_groups import OffPolicyOptions, WarmupOptions
from trl_plugins.api.reasons import EDITS_COMPLETIONS, IMAGES_TEXT_TEACHER
from trl_plugins.api.success import SuccessOptions
from trl_plugins.components.prm import PRMOptions, prm_from_options
from trl_plugins.components.steps import first_error, token_boundary
from trl_plugins.components.teacher import ReferenceTeacher, TeacherEndpointOptions, shared_teacher


@dataclass
class ScopeOptions(PRMOptions, TeacherEndpointOptions, OffPolicyOptions, WarmupOptions, SuccessOptions):
    plugin_name: ClassVar[str] = "scope"
    reconstructed_options = ("gamma",)  # the paper does not state how its corrections are trained off-policy

    mode: Literal["teacher_suffix", "teacher_step", "reference_suffix"] = option(
        "teacher_suffix", reconstructed=True,
        help="Rectification: the teacher continues to the end (teacher_suffix), writes only the wrong step and the "
        "policy continues (teacher_step), or the reference solution continues (reference_suffix).",
    )
    teacher: Literal["endpoint", "hf", "reference"] = option(
        "endpoint", reconstructed=True,
        help="Who writes corrections in the teacher_* modes: an OpenAI-compatible server, a local HF model, or the "
        "dataset's reference solution.",
    )
    teacher_temperature: float = option(0.0, min=0.0, reconstructed=True, help="Teacher sampling temperature.")
    teacher_max_tokens: int | None = option(
        None, min=1, help="Longest correction in tokens (None: the run's max_completion_length)."
    )
    step_separator: str | None = option(
        None, reconstructed=True,
        help="Step separator of completions (None: the PRM's convention, '\\n\\n'; one line for 'programmatic').",
    )
    threshold: float = option(0.5, reconstructed=True, help="A step is wrong when its PRM score is below this (tau).")
    scope_groups: Literal["all", "no_success", "partial"] = option(
        "all", reconstructed=True,
        help="Groups whose failures are repaired: all, only all-fail groups, or only groups with a success.",
    )
    no_error_policy: Literal["skip", "last_step"] = option(
        "skip", reconstructed=True,
        help="A failed rollout whose steps all pass the PRM: skip it, or treat its last step as the error.",
    )
    min_prefix_steps: int = option(
        1, min=0, reconstructed=True,
        help="Repair only if at least this many verified steps precede the first error (0 also repairs from "
        "scratch, LUFFY-style).",
    )
    accept: Literal["correct_only", "improved", "any"] = option(
        "correct_only", reconstructed=True,
        help="Keep a repair if it is correct (verifier > success_threshold), if its verifier value beats the "
        "original's, or always.",
    )
    max_per_group: int = option(1, min=1, reconstructed=True, help="Most repaired rollouts per group (M).")
    tie_break: Literal["random", "first"] = option(
        "random", reconstructed=True,
        help="Among repairs with the same verified prefix: a seeded random one, or the first in the group.",
    )
    success_threshold: float = option(
        0.5, help="A rollout is correct when its verifier column (success_column) is above this value (NaN = failure)."
    )
    append_eos: bool = option(True, help="End teacher / reference corrections with the EOS token.")
    solution_column: str = option("solution", help="Dataset column with the reference solution (reference modes).")
    problem_column: str = option("problem", help="Dataset column read by the programmatic PRM.")

    def validate(self) -> None:
        self.require_base_url(
            "teacher", "scope", active=self.mode != "reference_suffix",
            otherwise="teacher='hf' with teacher_model, teacher='reference', or mode='reference_suffix'",
        )
        super().validate()
        if self.step_separator == "":
            raise PluginConfigError("Option 'step_separator' of plugin 'scope' must not be empty.")



@dataclass
class _Repair:
    """One failed rollout being repaired (local row ``row``)."""

    row: int
    first_error: int  # 0-based step index = number of verified steps kept
    prefix_tokens: int  # L: completion tokens kept
    prefix_text: str
    ids: list[int] | None = None
    offpolicy: list[bool] | None = None
    logprobs: list[float] | None = None
    correction: list[int] | None = None  # suffix modes: the tokens spliced after the prefix


class ScopePlugin(Plugin):
    """PRM-located first error; verified prefix kept, rest rectified off-policy (sampling stage)."""

    name = "scope"
    image_inputs = True
    multi_turn = EDITS_COMPLETIONS
    version = "0.1.0"
    paper = (
        "Recycling Failures: Salvaging Exploration in RLVR via Fine-Grained Off-Policy Guidance (SCOPE), "
        "arXiv:2602.24110"
    )
    summary = "Failed rollouts keep their PRM-verified prefix; the rest is corrected off-policy and must verify."
    Options = ScopeOptions
    official = OfficialSource(
        None, verdict="reconstructed",
        note="No official code was found; compared with the paper's abstract and summaries: the step correction, its "
        "thresholds and acceptance rules are reconstructed.",
    )
    claim_metric = ("rectified_fraction", "rollouts salvaged (rectified)")
    replaces = ("the suffix of failed completions after their verified prefix (off-policy corrections)",)
    reconstructed = (
        "who corrects: a teacher endpoint (teacher='endpoint'); the paper does not name its corrector",
        "mode='teacher_suffix': the teacher rewrites everything from the first wrong step",
        "PRM Qwen/Qwen2.5-Math-PRM-7B, step separator '\\n\\n' (its convention), threshold tau = 0.5",
        "scope_groups='all': failures of every group are candidates",
        "no_error_policy='skip': a failure the PRM finds no error in is left alone",
        "min_prefix_steps=1: an error at the first step leaves nothing to salvage and is skipped",
        "accept='correct_only': only repairs that pass the training reward are kept",
        "max_per_group=1 (M), longest verified prefix first, seeded random tie-break",
        "gamma = 0.1 of the shaped off-policy branch (LUFFY)",
    )

    def image_inputs_refusal(self) -> str | None:
        """Image prompts: ``reference_suffix`` splices the dataset's reference text (no model reads the prompt); the
        teacher modes ask a text teacher (and ``teacher_step`` continues through the generation service)."""
        mode = self.options.mode
        if mode != "reference_suffix":
            return f"with mode={mode!r}, {IMAGES_TEXT_TEACHER}"
        return None

    def __init__(self, options=None):
        super().__init__(options)
        self.prm = None
        self.teacher = None
        self._seed = 0

    def required_columns(self) -> list[str]:
        o = self.options
        cols = []
        if o.mode == "reference_suffix" or (o.teacher == "reference" and o.mode != "reference_suffix"):
            cols.append(o.solution_column)
        if o.prm == "programmatic":
            cols.append(o.problem_column)
        return cols

    # ------------------------------------------------------------------------------------------ lifecycle
    @hookimpl
    def trl_plugins_configure(self, trainer, args):
        o = self.options
        o.check_gamma(self.name, args)
        self._seed = int(getattr(args, "seed", 0) or 0)
        if self.prm is None:
            self.prm = prm_from_options(o)
        if self.teacher is None:
            self.teacher = self._build_teacher(getattr(trainer, "max_completion_length", None))

    def _build_teacher(self, max_completion_length: int | None = None):
        o = self.options
        separator = self.prm.separator if self.prm is not None else (o.step_separator or "\n\n")
        if o.mode == "reference_suffix" or o.teacher == "reference":
            return ReferenceTeacher(o.solution_column, separator)
        max_tokens = o.teacher_max_tokens or max_completion_length or 1024
        return shared_teacher(
            o.teacher, **o.endpoint_kwargs("teacher"), temperature=o.teacher_temperature, max_tokens=max_tokens,
        )

    # ------------------------------------------------------------------------------------------ sampling
    @hookimpl
    def trl_plugins_after_generation(self, ctx: RolloutContext):
        o = self.options
        if o.warming_up(ctx.step):
            return
        if self.prm is None:
            self.prm = prm_from_options(o)
        if self.teacher is None:
            self.teacher = self._build_teacher(ctx.run.max_completion_length)
        tok = ctx.tokenizer
        G, B = ctx.num_generations, len(ctx)
        device = context_device(ctx)

        columns = ctx.reward_columns(range(B))
        local_scores = columns.verifier(o.success_rule).float().cpu()  # (B,) verifier values, NaN = failure
        success = ctx.gather(columns.success(o.success_rule).to(device)).cpu()  # (N,) bool, on the verifier only
        has_success = success.view(-1, G).any(dim=1)
        eligible = {"all": torch.ones_like(has_success), "no_success": ~has_success, "partial": has_success}[
            o.scope_groups
        ]
        candidates = [
            i for i in range(B)
            if not bool(success[ctx.global_index[i]]) and bool(eligible[ctx.group_ids[i]]) and ctx.completion_ids[i]
        ]
        repairs, no_error = self._locate(ctx, candidates, tok)
        self._rectify(ctx, repairs, tok)  # teacher_step: one collective service call, even with no repair
        tried = [r for r in repairs if r.ids is not None]
        accepted = self._accept(ctx, tried, local_scores)
        chosen = self._choose(ctx, accepted)
        for r in chosen:
            if r.correction is not None:
                ctx.splice(r.row, r.prefix_tokens, r.correction, offpolicy=True)
            else:
                ctx.replace_row(r.row, r.ids, offpolicy=r.offpolicy, logprobs=r.logprobs)
            ctx.annotations[r.row]["scope_first_error"] = r.first_error
            ctx.annotations[r.row]["scope_prefix_tokens"] = r.prefix_tokens
        self._log(ctx, success.numel(), candidates, no_error, tried, accepted, chosen, device)

    def _decode(self, tok, ids) -> str:
        return tok.decode(list(ids), skip_special_tokens=True)

    def _locate(self, ctx: RolloutContext, rows: list[int], tok) -> tuple[list[_Repair], int]:
        """PRM step scores of the candidates (local, batched) -> first error -> token-exact prefix length."""
        o = self.options
        texts = [self._decode(tok, ctx.completion_ids[i]) for i in rows]
        # collective: a PRM failure on one process (dead endpoint, bad row) stops every process together
        step_scores = run_together(
            ctx, "scope", lambda: self.prm.score_steps([ctx.rows[i] for i in rows], texts) if rows else []
        )
        repairs, no_error = [], 0
        for i, text, scores in zip(rows, texts, step_scores):
            spans = self.prm.steps(text)
            k = first_error(scores, o.threshold)
            if k is None:
                no_error += 1
                if o.no_error_policy != "last_step" or not spans:
                    continue
                k = len(spans) - 1
            if k < o.min_prefix_steps:
                continue
            ids = ctx.completion_ids[i]
            cut = token_boundary(ids, spans[k].start, lambda x: self._decode(tok, x))
            if cut == 0 and o.min_prefix_steps > 0:
                continue
            repairs.append(_Repair(i, k, cut, self._decode(tok, ids[:cut])))
        return repairs, no_error

    def _rectify(self, ctx: RolloutContext, repairs: list[_Repair], tok) -> None:
        """Fill each repair's candidate ids / provenance / log-probs (teacher_step: policy continuation)."""
        o = self.options
        max_len = ctx.run.max_completion_length
        eos = [tok.eos_token_id] if o.append_eos and tok.eos_token_id is not None else []
        rows = [ctx.rows[r.row] for r in repairs]
        prompts = [ctx.prompts[r.row] for r in repairs]
        prefixes = [r.prefix_text for r in repairs]
        max_tokens = o.teacher_max_tokens or max_len
        if o.mode != "teacher_step":
            texts = run_together(
                ctx, "scope",
                lambda: self.teacher.continue_from(rows, prompts, prefixes, max_tokens=max_tokens) if repairs else [],
            )
            for r, text in zip(repairs, texts):
                new = list(tok(text, add_special_tokens=False)["input_ids"]) + eos
                new = new[: max(max_len - r.prefix_tokens, 0)]
                if not new:
                    continue
                r.correction = new
                r.ids = ctx.completion_ids[r.row][: r.prefix_tokens] + new
            return
        separator = self.prm.separator
        steps = run_together(  # collective: a missing reference solution on one process stops every process
            ctx, "scope",
            lambda: self.teacher.continue_from(rows, prompts, prefixes, stop=[separator], max_tokens=max_tokens)
            if repairs else [],
        )
        requests, step_ids = [], []
        for r, step in zip(repairs, steps):
            ids = list(tok(step + separator, add_special_tokens=False)["input_ids"]) if step.strip() else []
            step_ids.append(ids)
            if ids:
                requests.append(r)
        prefix_ids = [
            (ctx.completion_ids[r.row][: r.prefix_tokens] + ids)[:max_len]
            for r, ids in zip(repairs, step_ids) if ids
        ]
        completions = ctx.service.generate(
            prompt_ids=[ctx.prompt_ids[r.row] for r in requests], prefix_ids=prefix_ids
        )  # collective: every process calls once per batch, possibly with no request
        sizes = {id(r): len(ids) for r, ids in zip(repairs, step_ids)}
        for r, completion in zip(requests, completions):
            n, L, s = len(completion.completion_ids), r.prefix_tokens, sizes[id(r)]
            flags = (ctx.offpolicy[r.row][:L] + [True] * s + [False] * n)[:n]
            r.ids, r.offpolicy = list(completion.completion_ids), flags
            if ctx.sampling_logprobs is not None:
                tail = list(completion.logprobs[L + s:]) if completion.logprobs is not None else []
                lps = list(ctx.sampling_logprobs[r.row][:L]) + [math.nan] * s + tail
                r.logprobs = (lps + [math.nan] * n)[:n]

    def _accept(self, ctx: RolloutContext, repairs: list[_Repair], original: torch.Tensor) -> list[_Repair]:
        o = self.options
        if not repairs:
            return []
        columns = ctx.reward_columns([r.row for r in repairs], [ctx.decode(r.ids, r.row) for r in repairs])
        correct = columns.success(o.success_rule).tolist()
        new_scores = torch.nan_to_num(columns.verifier(o.success_rule).float().cpu(), nan=-math.inf)
        before = torch.nan_to_num(original, nan=-math.inf)
        out = []
        for r, ok, score in zip(repairs, correct, new_scores.tolist()):
            if o.accept == "any" or (o.accept == "correct_only" and ok) or (
                o.accept == "improved" and score > float(before[r.row])
            ):
                out.append(r)
        return out

    def _choose(self, ctx: RolloutContext, accepted: list[_Repair]) -> list[_Repair]:
        """At most ``max_per_group`` repairs per group, longest verified prefix first (decided on gathered data)."""
        o = self.options
        G, B = ctx.num_generations, len(ctx)
        device = context_device(ctx)
        priority = torch.full((B,), -math.inf)
        for r in accepted:
            priority[r.row] = r.first_error + 0.5 * self._tie_value(ctx, r.row)
        all_priority = ctx.gather(priority.to(device)).cpu().view(-1, G)
        chosen_global = set()
        for g in range(all_priority.size(0)):
            values = all_priority[g]
            order = torch.argsort(values, descending=True, stable=True)[: o.max_per_group]
            chosen_global.update(g * G + int(j) for j in order if math.isfinite(float(values[j])))
        return [r for r in accepted if ctx.global_index[r.row] in chosen_global]

    def _tie_value(self, ctx: RolloutContext, row: int) -> float:
        """A value in [0, 1): seeded per (seed, step, global row) -- identical on every process."""
        if self.options.tie_break == "first":
            return 1.0 - (ctx.index_in_group[row] + 1) / (ctx.num_generations + 1)
        generator = torch.Generator().manual_seed(self._seed * 1_000_003 + ctx.step * 7_919 + ctx.global_index[row])
        return float(torch.rand((), generator=generator))

    def _log(self, ctx, N, candidates, no_error, tried, accepted, chosen, device) -> None:
        stats = torch.tensor(
            [
                len(candidates), no_error, len(tried), len(accepted), len(chosen),
                sum(r.first_error for r in chosen),
                sum(r.prefix_tokens / max(len(r.ids), 1) for r in chosen),
            ],
            dtype=torch.float64,
        )
        total = ctx.gather(stats.view(1, -1).to(device)).cpu().sum(dim=0).tolist()
        n_candidates, n_no_error, n_tried, n_accepted, n_chosen, sum_k, sum_frac = total
        ctx.log_metric("candidate_fraction", n_candidates / N)
        ctx.log_metric("rectified_fraction", n_chosen / N)
        ctx.log_metric("acceptance_rate", n_accepted / n_tried if n_tried else 0.0)
        ctx.log_metric("repairs_tried", n_tried)
        if n_candidates:
            ctx.log_metric("prm_no_error_fraction", n_no_error / n_candidates)
        self.report_fallback(
            ctx, "prm_found_no_error",
            self.options.no_error_policy == "skip" and bool(n_candidates) and n_no_error == n_candidates,
            "the PRM found no wrong step in any failed rollout of this batch (it disagrees with the verifier), so "
            "every repair was skipped (no_error_policy='skip') and the step is plain GRPO. Check the PRM and its "
            "threshold, or set no_error_policy='last_step'.",
        )
        if n_chosen:
            ctx.log_metric("mean_prefix_steps", sum_k / n_chosen)
            ctx.log_metric("prefix_token_fraction", sum_frac / n_chosen)


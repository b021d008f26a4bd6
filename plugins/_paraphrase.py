"""Shared paraphrase-group seam of ``ps_grpo`` and ``ic_grpo``: each group's G rows spread over a paraphrase set.

For a row whose ``paraphrase_column`` holds ``m`` paraphrases (and ``t`` rewording ``templates``), the group's G rows
are spread over ``n = min(1 + m + t, max_paraphrases + 1, G)`` variants: row ``k`` of the group takes variant
``k mod n`` (variant 0 is the original prompt, then the column's paraphrases, then the templates applied to the
question). Each row is sampled from *and trained on* its variant (its last user message replaced, the system and
earlier messages kept; a single-turn prompt is a fresh conversation, which is the papers' context reset). With
``max_paraphrases = 0`` a plugin using this seam enables no hook (vanilla GRPO).

Reconstructed (both papers): the round-robin assignment of rows to variants and paraphrases read from a dataset
column or made by templates (the papers generate them with an LLM).
"""

from __future__ import annotations

from dataclasses import dataclass

from trl_plugins.api import PluginConfigError, PromptContext, RewardContext, hookimpl, option
from trl_plugins.api.data_checks import check_column_values
from trl_plugins.api.options import PluginOptions
from trl_plugins.api.text import completion_text, last_user_text, with_last_user_text


@dataclass
class ParaphraseOptions(PluginOptions):
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

    def check_templates(self, plugin: str) -> None:
        """Refuse a template without ``'{question}'`` (called by the plugin's ``validate``)."""
        bad = [t for t in self.templates if "{question}" not in t]
        if bad:
            raise PluginConfigError(
                f"Option 'templates' of plugin {plugin!r} got {bad[0]!r}; allowed: strings holding '{{question}}'."
            )


def variant_of(index_in_group: int, num_variants: int) -> int:
    """The variant (0 = original) row ``index_in_group`` of a group with ``num_variants`` variants is sampled from."""
    return index_in_group % num_variants


class ParaphraseGroups:
    """Mixin of a :class:`~trl_plugins.api.Plugin` whose options derive from :class:`ParaphraseOptions`: the prompt
    stage hook spreading each group over its paraphrase set, the column check and :meth:`group_variants`."""

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

    def check_paraphrase_column(self, trainer) -> None:
        """Refuse a paraphrase column whose values are not lists of non-empty strings (at construction)."""
        if self.options.paraphrase_column is None:
            return
        check_column_values(
            self.name, getattr(trainer, "train_dataset", None), self.options.paraphrase_column,
            lambda v: isinstance(v, (list, tuple)) and all(isinstance(p, str) and p.strip() for p in v),
            "a list of non-empty paraphrase strings (possibly empty)",
        )

    def group_variants(self, ctx: RewardContext) -> list[int]:
        """(N,) variant of every row of the gathered batch (every process alike), from the rows' variant counts."""
        G = ctx.num_generations
        counts = ctx.gather_object([self.num_variants(row, G) for row in ctx.local_rows])
        return [variant_of(i % G, counts[i - i % G]) for i in range(len(counts))]

    def gathered_texts_and_variants(self, ctx: RewardContext) -> tuple[list[str], list[int]] | None:
        """(N,) completion texts and (N,) variants of the gathered batch (collective: call it on every process);
        None in evaluation, whose prompts are not paraphrased (a plugin's columns then stay 0)."""
        if ctx.mode != "train":
            return None
        return ctx.gather_object([completion_text(c) for c in ctx.local_completions]), self.group_variants(ctx)

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


def variants_mean(variants: list[int], group_size: int) -> float:
    """Mean number of variants per row of a batch (the ``variants_mean`` metric), from the rows' variants."""
    groups = [variants[g:g + group_size] for g in range(0, len(variants), group_size)]
    return sum((max(v) + 1) * len(v) for v in groups) / max(len(variants), 1)

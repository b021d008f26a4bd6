"""Checks of the training data at trainer construction: the dataset and the columns plugins read.

:func:`check_training_dataset` refuses what TRL would only trip over at the first step (an empty dataset, no
``prompt`` column, prompts that are neither text nor chat messages). :func:`check_column_filled` is for plugins: a
column the method depends on that is empty in *every* row (None, blank text, empty list) defeats the method and is
refused; empty in *some* rows is a warning with the count and the first such row. Datasets without ``column_names``
or without a length (streaming ``IterableDataset``) are not checked.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

from .errors import PluginConfigError


def _columns(dataset: Any) -> list[str] | None:
    columns = getattr(dataset, "column_names", None)
    if isinstance(columns, dict):  # DatasetDict
        columns = next(iter(columns.values()), None)
    return columns


def _sized(dataset: Any) -> bool:
    try:
        len(dataset)
    except TypeError:
        return False
    return True


def is_blank(value: Any) -> bool:
    """None, blank text or an empty list / dict: no usable value."""
    if value is None:
        return True
    if isinstance(value, str):
        return not value.strip()
    if isinstance(value, (list, tuple, dict)):
        return len(value) == 0
    return False


def check_training_dataset(dataset: Any, environment_owned: bool = False) -> None:
    """Refuse an empty training dataset, one without a ``prompt`` column, or prompts of the wrong type.

    ``environment_owned``: the run has an ``environment_factory``; as in TRL, the ``prompt`` column is then optional
    (each rollout's prompt comes from the environment's ``reset()``, e.g. a dataset of ``environment`` names only).
    """
    if dataset is None or not _sized(dataset):
        return
    if len(dataset) == 0:
        raise PluginConfigError("The training dataset is empty (0 rows): there is nothing to train on.")
    columns = _columns(dataset)
    if columns is None:
        return
    if "prompt" not in columns:
        if environment_owned:
            return
        raise PluginConfigError(
            f"The training dataset has no 'prompt' column (columns: {', '.join(columns)}). GRPO generates from it: "
            "rename your prompt column to 'prompt' (text, or a list of {'role', 'content'} messages)."
        )
    prompt = dataset[0]["prompt"]
    if not (isinstance(prompt, str) or (isinstance(prompt, list) and all(isinstance(m, dict) for m in prompt))):
        raise PluginConfigError(
            f"Row 0 of the training dataset has a 'prompt' of type {type(prompt).__name__} ({prompt!r:.80}); "
            "a prompt is text or a list of {'role', 'content'} messages."
        )


def check_column_filled(
    plugin: str,
    dataset: Any,
    column: str,
    why: str,
    blank: Callable[[Any], bool] = is_blank,
    blank_means: str = "empty (None or blank)",
) -> None:
    """Refuse a ``column`` that is blank in every row; warn with the count when it is blank in some.

    Args:
        plugin: the plugin's name, for the message.
        why: what the plugin uses the column for (one clause, e.g. "the critique names the correct answer").
        blank: what counts as an unusable value (default :func:`is_blank`); ``blank_means`` says it in words.
    """
    columns = _columns(dataset)
    if columns is None or column not in columns or not _sized(dataset):
        return  # a missing column is reported by Plugin.required_columns()
    values = dataset[column]
    empty = [i for i, value in enumerate(values) if blank(value)]
    if not empty:
        return
    if len(empty) == len(values):
        raise PluginConfigError(
            f"{plugin}: column {column!r} is {blank_means} in every one of the {len(values)} rows; {why}. "
            "Fill the column, or point the plugin at the right one with its column option."
        )
    warnings.warn(
        f"{plugin}: column {column!r} is {blank_means} in {len(empty)} of {len(values)} rows (first: row {empty[0]}, "
        f"{values[empty[0]]!r:.40}); {why}.",
        stacklevel=2,
    )


def cell_problem(plugin: str, column: str, row: int, value: Any, ok: Callable[[Any], bool], allowed: str) -> str | None:
    """The sentence refusing ``value`` of ``column`` in ``row`` (naming plugin, column, row, value and what is
    allowed), or None when ``ok(value)``. For checks of cells that only exist at run time (streamed rows)."""
    if ok(value):
        return None
    return (f"{plugin}: column {column!r} holds {type(value).__name__} {value!r:.60} in row {row}; allowed: "
            f"{allowed}.")


def check_column_values(plugin: str, dataset: Any, column: str, ok: Callable[[Any], bool], allowed: str) -> None:
    """Refuse at construction the first row whose ``column`` value fails ``ok`` (a :class:`PluginConfigError`
    naming plugin, column, row, value, how many rows are wrong and what is allowed). Datasets without a length or
    without the column are not checked (a missing column is reported by ``Plugin.required_columns()``)."""
    columns = _columns(dataset)
    if columns is None or column not in columns or not _sized(dataset):
        return
    values = dataset[column]
    wrong = [i for i, value in enumerate(values) if not ok(value)]
    if wrong:
        raise PluginConfigError(
            f"{cell_problem(plugin, column, wrong[0], values[wrong[0]], ok, allowed)[:-1]} ({len(wrong)} of "
            f"{len(values)} rows are wrong)."
        )

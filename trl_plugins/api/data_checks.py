"""Checks of the columns plugins read, at configure (the dataset itself: :mod:`trl_plugins.guards.dataset_guard`).

:func:`check_column_filled` is for plugins: a column the method depends on that is empty in *every* row (None, blank
text, empty list) defeats the method and is refused; empty in *some* rows is a warning with the count and the first such
row. Datasets without ``column_names`` or without a length (streaming ``IterableDataset``) are not checked.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

from trl_plugins.api.errors import PluginConfigError


def dataset_columns(dataset: Any) -> list[str] | None:
    """The column names of a dataset (of a ``DatasetDict``'s first split); None when it has none."""
    columns = getattr(dataset, "column_names", None)
    if isinstance(columns, dict):  # DatasetDict
        columns = next(iter(columns.values()), None)
    return columns


#: The columns TRL's GRPOTrainer reads images from (``images``: a list per row; ``image``: one per row).
IMAGE_COLUMNS = ("image", "images")


def has_image_prompts(dataset: Any) -> bool:
    """Whether the dataset's prompts carry images: it has one of TRL's :data:`IMAGE_COLUMNS` (column names, or the
    features of a streaming dataset). A ``dict`` of datasets (TRL's eval datasets) counts when any of them does."""
    if isinstance(dataset, dict) and not hasattr(dataset, "column_names"):
        return any(has_image_prompts(d) for d in dataset.values())
    columns = dataset_columns(dataset)
    if columns is None:
        features = getattr(dataset, "features", None)
        columns = list(features) if features else []
    return any(c in IMAGE_COLUMNS for c in columns)


def is_sized(dataset: Any) -> bool:
    """Whether the dataset has a length (a streaming ``IterableDataset`` has none)."""
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
    columns = dataset_columns(dataset)
    if columns is None or column not in columns or not is_sized(dataset):
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
    columns = dataset_columns(dataset)
    if columns is None or column not in columns or not is_sized(dataset):
        return
    values = dataset[column]
    wrong = [i for i, value in enumerate(values) if not ok(value)]
    if wrong:
        raise PluginConfigError(
            f"{cell_problem(plugin, column, wrong[0], values[wrong[0]], ok, allowed)[:-1]} ({len(wrong)} of "
            f"{len(values)} rows are wrong)."
        )

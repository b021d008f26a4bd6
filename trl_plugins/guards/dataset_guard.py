"""The training dataset checked at trainer construction, before TRL would only trip over it at the first step.

:func:`check_training_dataset` refuses an empty dataset, one without a ``prompt`` column, and prompts that are
neither text nor chat messages. The columns plugins read are checked by the plugins themselves
(:mod:`trl_plugins.api.data_checks`). Datasets without ``column_names`` or without a length (streaming
``IterableDataset``) are not checked.
"""

from __future__ import annotations

from typing import Any

from trl_plugins.api.data_checks import dataset_columns, is_sized
from trl_plugins.api.errors import PluginConfigError


def check_training_dataset(dataset: Any, environment_owned: bool = False) -> None:
    """Refuse an empty training dataset, one without a ``prompt`` column, or prompts of the wrong type.

    ``environment_owned``: the run has an ``environment_factory``; as in TRL, the ``prompt`` column is then optional
    (each rollout's prompt comes from the environment's ``reset()``, e.g. a dataset of ``environment`` names only).
    """
    if dataset is None or not is_sized(dataset):
        return
    if len(dataset) == 0:
        raise PluginConfigError("The training dataset is empty (0 rows): there is nothing to train on.")
    columns = dataset_columns(dataset)
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

"""Reward guard: NaN / inf rewards are refused with a message naming the reward function, the row and the value.

TRL turns a reward function's ``None`` into NaN on purpose: it means "this function does not score this
completion" (e.g. a code reward on a math row), and the weighted ``nansum`` simply skips it. A reward function that
*computes* NaN or +-inf is a different thing -- a division by zero, a log of zero, a judge score that did not parse --
and TRL cannot tell the two apart after the conversion: the NaN silently drops out of the combined reward and an
inf turns a whole group's advantages into NaN. The guard checks every value a reward function returns, before
TRL converts ``None``:

* ``None`` stays allowed (unscorable);
* a number (Python, NumPy or 0-d tensor; ``bool`` counts as 0/1) must be finite;
* anything else (a string, a list ...) is refused too.

A list of the wrong length is refused the same way (TRL would raise too, but after the call, out of the guard's reach).

The error (:class:`RewardValueError`) names the reward function as TRL logs it, the row of the call (its index in the
batch the function received, with the process index when several run), the value, and the beginning of the prompt
and completion. :func:`guard_reward_funcs` wraps callables (sync and async alike) and leaves reward models
(``nn.Module``, or a model id string) alone; the wrapped callables keep TRL's display name
(:func:`trl.trainer.utils.get_callable_name`) and every attribute of the original (``reward_weight``...).

:func:`check_reward_columns` is the construction-time half: a reward function with a required parameter that is not a
dataset column (and not one of the arguments TRL passes itself) is refused before training starts, naming the
function, the parameter and the dataset's columns -- instead of a ``TypeError`` at the first step.

With several processes a reward function may fail on one of them only (a NaN for one row, a judge timing out), while
the others go on to TRL's gather of the reward matrix and would wait there until the collective's timeout. The
trainer therefore hands the guards a :class:`~trl_plugins.api.collectives.HeldRewardErrors`: while it is holding, a
failing call records its error and returns placeholder zeros (so do the remaining reward functions, without running),
TRL's gather completes on every process, and the trainer then raises on every process together (the failing one its
own error, the others a ``PluginError`` naming it; the flag mechanics are in :mod:`trl_plugins.api.collectives`).
"""

from __future__ import annotations

import inspect
import math
import warnings
from collections.abc import Sequence
from typing import Any

from trl_plugins.api.collectives import HeldRewardErrors
from trl_plugins.api.errors import PluginConfigError, PluginError

__all__ = ["RewardValueError", "check_reward_columns", "check_reward_values", "guard_reward_funcs", "is_guarded"]

#: Arguments TRL passes to every reward function besides the dataset columns.
TRL_REWARD_ARGUMENTS = frozenset(
    {"prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric", "environments"}
)


class RewardValueError(PluginError, ValueError):
    """A reward function returned NaN, +-inf or something that is not a number (``None`` is allowed)."""


def _excerpt(value: Any, limit: int = 80) -> str:
    if isinstance(value, list) and value and isinstance(value[-1], dict):  # conversational: the last message
        value = value[-1].get("content", "")
    text = str(value)
    return repr(text if len(text) <= limit else text[:limit] + "...")


def _process_note() -> str:
    try:
        from accelerate.state import PartialState

        if PartialState._shared_state and PartialState().num_processes > 1:
            return f" on process {PartialState().process_index}"
    except Exception:  # the guard must never fail for a reason of its own
        pass
    return ""


def check_reward_values(name: str, values: Any, prompts: Sequence | None = None, completions: Sequence | None = None):
    """Raise :class:`RewardValueError` for the first NaN, inf or non-numeric value in ``values`` (None is skipped),
    or when ``values`` does not hold one value per prompt."""
    if values is None:
        raise RewardValueError(
            f"Reward function {name!r} returned None instead of a list of rewards (one per completion; use None "
            "inside the list for completions it cannot score)."
        )
    if prompts is not None and hasattr(values, "__len__") and len(values) != len(prompts):
        raise RewardValueError(
            f"Reward function {name!r} returned {len(values)} rewards for {len(prompts)} completions"
            f"{_process_note()}; it must return exactly one value (or None) per completion."
        )
    if hasattr(values, "__len__") and len(values) and all(value is None for value in values):
        warnings.warn(
            f"Reward function {name!r} returned None for every one of the {len(values)} completions it was given"
            f"{_process_note()}: it scored nothing (TRL leaves it out of the weighted sum for these rows). If that is "
            "not meant (e.g. a column name it reads is wrong), fix the function; if no reward function scores a "
            "group, its advantages are zero and nothing is learnt from it.",
            stacklevel=2,
        )
    for i, value in enumerate(values):
        if value is None:
            continue
        problem = None
        try:
            if isinstance(value, (str, bytes)):  # float("0.5") works, TRL's torch.tensor of the column does not
                raise TypeError(value)
            number = float(value)
        except (TypeError, ValueError):
            problem = f"{value!r} ({type(value).__name__}), which is not a number"
        else:
            if math.isnan(number):
                problem = "nan"
            elif math.isinf(number):
                problem = "inf" if number > 0 else "-inf"
        if problem is None:
            continue
        where = f"row {i} of the {len(values)} rows it was given{_process_note()}"
        details = []
        if prompts is not None and i < len(prompts):
            details.append(f"prompt {_excerpt(prompts[i])}")
        if completions is not None and i < len(completions):
            details.append(f"completion {_excerpt(completions[i])}")
        context = f" ({', '.join(details)})" if details else ""
        raise RewardValueError(
            f"Reward function {name!r} returned {problem} for {where}{context}. Rewards must be finite numbers; "
            "return None for a completion the function cannot score (TRL then ignores that column for the row)."
        )


def _materialised(values: Any) -> Any:
    """A generator or other one-pass iterator of rewards as a list (TRL accepts them; checking would consume them)."""
    if values is not None and not hasattr(values, "__len__") and hasattr(values, "__iter__"):
        return list(values)
    return values


def _placeholder(kwargs: dict) -> list[float]:
    """Zeros, one per prompt of the call: what a reward function whose step is lost returns while errors are held."""
    return [0.0] * len(kwargs.get("prompts") or ())


class _GuardedReward:
    """A reward callable that checks what the wrapped one returns (see the module docstring)."""

    def __init__(self, func: Any, name: str, held: HeldRewardErrors | None = None):
        self.__wrapped__ = func
        self.__name__ = name
        self.__qualname__ = name
        self.__doc__ = getattr(func, "__doc__", None)
        self._held = held
        for key, value in getattr(func, "__dict__", {}).items():  # reward_weight and other plugin attributes
            if not key.startswith("__"):
                self.__dict__.setdefault(key, value)

    @property
    def __signature__(self):  # callers inspecting the reward function see the original parameters
        return inspect.signature(self.__wrapped__)

    def __call__(self, *args, **kwargs):
        if self._held is not None and self._held.failed:  # the step fails anyway: no judge calls for nothing
            return _placeholder(kwargs)
        try:
            values = _materialised(self.__wrapped__(*args, **kwargs))
            check_reward_values(self.__name__, values, kwargs.get("prompts"), kwargs.get("completions"))
        except Exception as exc:
            return self._placeholder_or_raise(exc, kwargs)
        return values

    def _placeholder_or_raise(self, error: Exception, kwargs: dict) -> list[float]:
        """Zeros for every row when the error is held (the trainer raises it after the reward gather)."""
        if self._held is None or not self._held.hold(error):
            raise error
        return _placeholder(kwargs)

    def __repr__(self) -> str:
        return f"<guarded reward {self.__name__}: {self.__wrapped__!r}>"


class _AsyncGuardedReward(_GuardedReward):
    async def __call__(self, *args, **kwargs):
        if self._held is not None and self._held.failed:
            return _placeholder(kwargs)
        try:
            values = _materialised(await self.__wrapped__(*args, **kwargs))
            check_reward_values(self.__name__, values, kwargs.get("prompts"), kwargs.get("completions"))
        except Exception as exc:
            return self._placeholder_or_raise(exc, kwargs)
        return values


def is_guarded(func: Any) -> bool:
    return isinstance(func, _GuardedReward)


def guard_reward_funcs(reward_funcs: Any, held: HeldRewardErrors | None = None) -> Any:
    """Wrap every callable reward function (sync or async) with the NaN / inf check; keep the container's shape.

    Strings (reward model ids) and ``nn.Module`` reward models are returned unchanged; already guarded callables
    are not wrapped twice. ``held``: where the guards hold their errors while it is holding (the trainer's).
    """
    from torch import nn
    from trl.trainer.utils import get_callable_name, is_async_callable

    def guard(func):
        if is_guarded(func):  # guarded before (e.g. by another trainer): keep the check, hold for this caller
            return func if held is None or func._held is held else type(func)(func.__wrapped__, func.__name__, held)
        if func is None or isinstance(func, (str, nn.Module)) or not callable(func):
            return func
        name = get_callable_name(func)
        cls = _AsyncGuardedReward if is_async_callable(func) else _GuardedReward
        return cls(func, name, held)

    if reward_funcs is None:
        return None
    if isinstance(reward_funcs, list):
        return [guard(f) for f in reward_funcs]
    return guard(reward_funcs)


def _required_columns(func: Any) -> list[str]:
    """Parameters of ``func`` that must come from dataset columns (required, not passed by TRL itself)."""
    try:
        signature = inspect.signature(func)
    except (TypeError, ValueError):
        return []
    required = []
    for param in signature.parameters.values():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        if param.default is param.empty and param.name not in TRL_REWARD_ARGUMENTS:
            required.append(param.name)
    return required


def check_reward_columns(reward_funcs: Any, dataset: Any) -> None:
    """Refuse a reward function that needs a column the training dataset lacks (at construction).

    A required parameter of a callable reward function (no default) that is neither one of the arguments TRL passes
    (``prompts``, ``completions``, ``completion_ids``, ``trainer_state``, ``log_extra``, ``log_metric``,
    ``environments``) nor a dataset column would make TRL fail with a ``TypeError`` at the first step. A function
    with a ``check_dataset(dataset)`` attribute has it called too (raise to refuse, warn to flag). Datasets without
    ``column_names`` (iterable datasets of unknown schema) are not checked.
    """
    from torch import nn
    from trl.trainer.utils import get_callable_name

    columns = getattr(dataset, "column_names", None)
    if columns is None or reward_funcs is None:
        return
    if isinstance(columns, dict):  # DatasetDict
        columns = next(iter(columns.values()))
    funcs = reward_funcs if isinstance(reward_funcs, list) else [reward_funcs]
    for func in funcs:
        if func is None or isinstance(func, (str, nn.Module)) or not callable(func):
            continue
        target = func.__wrapped__ if is_guarded(func) else func
        check_dataset = getattr(target, "check_dataset", None)
        if callable(check_dataset):  # a reward function's own data check (e.g. accuracy_reward's answer column)
            check_dataset(dataset)
        for name in _required_columns(target):
            if name not in columns:
                raise PluginConfigError(
                    f"Reward function {get_callable_name(func)!r} needs the dataset column {name!r} (a required "
                    f"parameter), which the training dataset does not have (columns: {', '.join(columns)}). Add the "
                    "column, or give the parameter a default."
                )

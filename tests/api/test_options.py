"""Typed plugin options: unknown keys (with suggestions), wrong types, ranges, choices, cross-field checks."""

from dataclasses import dataclass
from typing import Literal

import pytest

from trl_plugins import PluginConfigError, PluginOptions, option


@dataclass
class DemoOptions(PluginOptions):
    kappa: float = option(0.02, min=0.0, max=1.0, min_exclusive=True, help="a fraction")
    steps: int = option(3, min=1, help="a count")
    mode: Literal["fast", "exact"] = option("exact", help="a choice")
    flag: bool = option(False, help="a switch")
    levels: list[float] = option(default_factory=lambda: [0.5], help="a list")
    limit: int | None = option(None, help="optional", reconstructed=True)
    scale: float | None = option(None, min=0.0, help="optional number")
    cap: float = option(float("inf"), allow_nonfinite=True, help="inf means no cap")


def test_defaults_and_valid_values():
    opts = DemoOptions.from_dict({"kappa": 1, "steps": 2, "mode": "fast", "flag": True, "levels": [1, 0.25]}, "demo")
    assert opts.kappa == 1.0 and isinstance(opts.kappa, float)  # ints are accepted for floats
    assert opts.levels == [1.0, 0.25] and opts.mode == "fast" and opts.flag is True
    assert DemoOptions.from_dict(None, "demo") == DemoOptions()


def test_unknown_key_suggests_close_match():
    with pytest.raises(PluginConfigError, match=r"Unknown option 'kapa' for plugin 'demo'\. Did you mean 'kappa'\?"):
        DemoOptions.from_dict({"kapa": 0.1}, "demo")


@pytest.mark.parametrize(
    "values, message",
    [
        ({"kappa": "0.1"}, r"'kappa' of plugin 'demo' got '0.1'; allowed: a number"),
        ({"steps": 2.5}, r"'steps' of plugin 'demo' got 2.5; allowed: an integer"),
        ({"steps": True}, r"allowed: an integer"),
        ({"flag": "yes"}, r"allowed: true or false"),
        ({"kappa": 0.0}, r"got 0.0; allowed: a value > 0.0 and <= 1.0"),
        ({"kappa": 1.5}, r"got 1.5; allowed: a value <= 1.0"),
        ({"steps": 0}, r"got 0; allowed: a value >= 1"),
        ({"mode": "fsat"}, r"got 'fsat'; allowed: 'fast', 'exact'\. Did you mean 'fast'\?"),
        ({"levels": 0.5}, r"allowed: a list"),
        ({"levels": ["a"]}, r"'levels\[0\]' of plugin 'demo' got 'a'"),
        ({"kappa": float("nan")}, r"got nan; allowed: a finite number \(> 0.0 and <= 1.0\)"),
        ({"kappa": float("inf")}, r"got inf; allowed: a finite number"),
        ({"levels": [0.5, float("-inf")]}, r"'levels\[1\]' of plugin 'demo' got -inf; allowed: a finite number"),
        ({"scale": float("nan")}, r"got nan; allowed: a finite number or None \(>= 0.0\)"),
        ({"scale": "big"}, r"got 'big'; allowed: a number or None"),
        ({"limit": 1.5}, r"got 1.5; allowed: an integer or None"),
    ],
)
def test_bad_values_are_refused_with_the_value_and_what_is_allowed(values, message):
    with pytest.raises(PluginConfigError, match=message):
        DemoOptions.from_dict(values, "demo")


def test_nonfinite_values_only_where_the_option_allows_them():
    assert DemoOptions.from_dict({"cap": float("nan")}, "demo").cap != DemoOptions().cap  # NaN passes through as is
    assert DemoOptions.from_dict({"cap": 5}, "demo").cap == 5.0
    assert DemoOptions.from_dict({"scale": None, "limit": None}, "demo").scale is None


def test_describe_prints_strict_lower_bounds_as_strict():
    infos = {i.name: i for i in DemoOptions.describe()}
    assert infos["kappa"].range_text() == "(0.0, 1.0]"
    assert infos["steps"].range_text() == ">= 1" and infos["scale"].range_text() == ">= 0.0"
    assert infos["flag"].range_text() is None


def test_describe_lists_every_option_with_help_and_reconstruction_flag():
    infos = {i.name: i for i in DemoOptions.describe()}
    assert list(infos) == ["kappa", "steps", "mode", "flag", "levels", "limit", "scale", "cap"]
    assert infos["mode"].choices == ("fast", "exact")
    assert infos["limit"].reconstructed and not infos["kappa"].reconstructed
    assert infos["levels"].default == [0.5]
    assert all(i.help for i in infos.values())

"""builtin:tiny ships its warm-started weights: every machine loads the same bytes, and the recipe that made them
(the warm start) still makes a model of the same quality here."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from trl_plugins.tasks import tiny
from trl_plugins.tasks.arithmetic import make_dataset
from trl_plugins.tasks.tiny import DemoSettings, demo_model, evaluate_accuracy, shipped_weights


def test_the_demo_settings_are_shipped_and_load_without_a_warm_start(tmp_path, monkeypatch):
    path = shipped_weights(DemoSettings())
    assert path is not None and path.stat().st_size < 2_000_000
    monkeypatch.setattr(tiny, "warm_start", lambda *a, **k: pytest.fail("the shipped model must not be warm-started"))
    model, _ = demo_model(tmp_path, DemoSettings())
    shipped = load_file(str(path))
    state = model.state_dict()
    assert state.keys() == shipped.keys()
    assert all(torch.equal(state[k], shipped[k]) for k in shipped)
    again, _ = demo_model(tmp_path, DemoSettings())  # from the per-user cache folder now, the same bytes
    assert all(torch.equal(again.state_dict()[k], shipped[k]) for k in shipped)


def test_other_settings_are_not_shipped():
    import dataclasses

    assert shipped_weights(dataclasses.replace(DemoSettings(), warm_start_steps=3)) is None


@pytest.mark.slow
def test_the_recipe_still_makes_a_model_of_the_shipped_quality():
    """Warm-start with the demo's settings on this machine and compare held-out greedy accuracy with the shipped
    model's on the same 128 problems (the weights themselves differ across machines; the quality must not)."""
    settings = DemoSettings()
    held_out = make_dataset(128, levels=settings.levels, seed=1, split="test")
    shipped, tokenizer = demo_model(None, settings)
    rebuilt, _ = tiny.warm_started_model(None, settings)
    a = evaluate_accuracy(shipped, tokenizer, held_out)
    b = evaluate_accuracy(rebuilt, tokenizer, held_out)
    assert a > 0.2 and abs(a - b) <= 0.15, (a, b)

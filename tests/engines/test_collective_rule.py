"""The testing kit's check of the collective-services rule (docs/writing-a-plugin.md, "Collective services"), and
the built-ins that call the policy for per-process rows honour it."""

from __future__ import annotations

import pytest
import torch

from trl_plugins import Plugin, hookimpl
from trl_plugins.testing import assert_collective_calls_even, make_rollout_context


def _logprobs(prompts, completions):
    return [torch.full((len(c),), -1.0) for c in completions]


def _contexts():
    # process 0 holds a group to probe ("1" answers), process 1 none
    return [make_rollout_context([["1", "x"]], process_index=0, policy_logprobs=_logprobs),
            make_rollout_context([["y", "x"]], process_index=1, policy_logprobs=_logprobs)]


class SkipsWhenEmpty(Plugin):
    name = "test_skips_when_empty"

    @hookimpl
    def trl_plugins_after_generation(self, ctx):
        rows = [i for i in range(len(ctx)) if ctx.completions[i][-1]["content"] == "1"]
        if rows:  # wrong: process 1 never joins the forward
            ctx.policy_logprobs([ctx.prompt_ids[i] for i in rows], [ctx.completion_ids[i] for i in rows])


class CallsEveryTime(Plugin):
    name = "test_calls_every_time"

    @hookimpl
    def trl_plugins_after_generation(self, ctx):
        rows = [i for i in range(len(ctx)) if ctx.completions[i][-1]["content"] == "1"]
        ctx.policy_logprobs([ctx.prompt_ids[i] for i in rows], [ctx.completion_ids[i] for i in rows])


def test_a_plugin_skipping_a_collective_call_on_one_process_fails_naming_the_service():
    with pytest.raises(AssertionError, match=r"policy_logprobs: \[1, 0\]"):
        assert_collective_calls_even(SkipsWhenEmpty, "after_generation", _contexts())


def test_one_call_per_process_with_no_rows_passes():
    counts = assert_collective_calls_even(CallsEveryTime, "after_generation", _contexts())
    assert counts["policy_logprobs"] == [1, 1]

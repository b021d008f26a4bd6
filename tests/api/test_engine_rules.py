"""The engine rules of ``trl_plugins.api.engines`` that need no launch (the launches: tests/engines/test_engines.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from trl_plugins import IncompatiblePluginsError
from trl_plugins.api.engines import (
    check_engine_support, gathered_lm_head, head_gradient_path, through_head_module, unwrap_causal_lm, whole_model_loading,
)
from trl_plugins.runtime.head_stats import lm_head_of
from trl_plugins.testing import tiny_model, tiny_tokenizer


class EngineLike(nn.Module):
    """Stands for a DeepSpeedEngine: a wrapper with a ``.module`` AND a ``.config`` of its own (DeepSpeed's dict)."""

    def __init__(self, module):
        super().__init__()
        self.module = module
        self.config = {"zero_optimization": {"stage": 2}}


def test_a_deepspeed_like_engine_is_unwrapped_and_the_logit_transform_read_from_the_model():
    model = tiny_model(tiny_tokenizer())
    model.config.final_logit_softcapping = 2.0
    model.config.logit_scale = 10.0
    wrapped = EngineLike(EngineLike(model))
    assert unwrap_causal_lm(wrapped) is model
    weight, bias, scale, softcap = lm_head_of(wrapped)
    assert (scale, softcap) == (10.0, 2.0)
    assert weight is model.get_output_embeddings().weight  # nothing to gather: the live parameter


def test_an_unknown_partial_head_is_refused_with_its_shape():
    model = tiny_model(tiny_tokenizer())
    head = model.get_output_embeddings()
    full = head.weight
    head.weight = nn.Parameter(full.detach().flatten()[:10].clone())  # a flat shard no rule knows
    with pytest.raises(RuntimeError, match=r"not whole here \(weight of shape \(10,\)\)"):
        with gathered_lm_head(model):
            pass


def test_a_plugin_unsupported_under_the_engine_is_refused_naming_plugin_engine_and_reason():
    from trl_plugins_builtin.siren import SirenPlugin

    plugin = SirenPlugin()
    check_engine_support([plugin], "zero3")  # supported
    with pytest.raises(IncompatiblePluginsError, match=r"under the fsdp1 engine: siren: .*gradient through the LM head"):
        check_engine_support([plugin], "fsdp1")


def test_local_models_load_outside_the_zero3_flag_and_it_is_restored():
    from transformers.integrations import deepspeed as hf_deepspeed

    class Zero3Config:
        def is_zero3(self):
            return True

    config = Zero3Config()
    hf_deepspeed.set_hf_deepspeed_config(config)
    try:
        assert hf_deepspeed.is_deepspeed_zero3_enabled()
        with whole_model_loading():
            assert not hf_deepspeed.is_deepspeed_zero3_enabled()
        assert hf_deepspeed.is_deepspeed_zero3_enabled()
    finally:
        hf_deepspeed.unset_hf_deepspeed_config()


def test_policy_logprobs_pads_to_the_largest_count_across_processes():
    """The service runs ONE padded forward of max-count rows on a process with fewer (or no) rows."""
    from types import SimpleNamespace

    from trl_plugins.runtime.policy_probe import PolicyProbe

    forwards = []
    probe = PolicyProbe(SimpleNamespace(eos_token_ids=[1]))
    probe._largest_count = lambda n_local: 3  # another process has 3 rows
    probe.forward = lambda p, c, entropy: forwards.append((len(p), len(c))) or torch.zeros(len(c), 2)
    assert probe.logprobs([], []) == [] and forwards == [(3, 3)]
    out = probe.logprobs([[5]], [[6, 7]])
    assert forwards[-1] == (3, 3) and len(out) == 1 and out[0].shape == (2,)


@pytest.mark.parametrize("with_bias", [False, True])
def test_a_head_gradient_through_the_head_module_equals_the_live_parameters_one(with_bias):
    """ZeRO-3's path (a module call on identity rows): values are the copies bit for bit, gradients those of autograd
    through the live parameters (here a plain Linear stands for the partitioned head)."""
    torch.manual_seed(0)
    head = nn.Linear(6, 11, bias=with_bias)
    h = torch.randn(5, 6)
    probe = torch.randn(5, 11)

    def loss(weight, bias):
        z = h @ weight.T + (0 if bias is None else bias)
        return (torch.tanh(z) * probe).sum()

    loss(head.weight, head.bias).backward()
    expected = [p.grad.clone() for p in head.parameters()]
    head.zero_grad()
    copies = (head.weight.detach().clone(), None if head.bias is None else head.bias.detach().clone())
    weight, bias = through_head_module(head, *copies)
    assert torch.equal(weight, copies[0]) and (bias is None or torch.equal(bias, copies[1]))
    loss(weight, bias).backward()
    for got, want in zip([p.grad for p in head.parameters()], expected):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_no_head_gradient_path_where_the_head_is_live():
    assert head_gradient_path(tiny_model(tiny_tokenizer())) is None  # autograd delivers it

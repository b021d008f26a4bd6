"""Liger kernels (``use_liger_kernel=True``) with plugins (issue 27, item 3).

What TRL 1.16 does with the flag: ``GRPOTrainer.__init__`` forces ``liger_kernel_config["fused_linear_cross_entropy"]``
to False (and refuses a config that sets it True: the fused loss would replace the model forward TRL patches with its
fused log-prob head), and transformers' ``Trainer.train`` then calls ``apply_liger_kernel(model, config)``, which
swaps layer kernels (RMSNorm, RoPE, SwiGLU) into the model instance. The loss is still computed from TRL's per-token
log-probs, so every plugin stage gets what it reads (per-token log-probs, entropies, head statistics): nothing is
refused. liger-kernel needs triton and a GPU, absent here, so ``apply_liger_kernel`` is replaced by a stand-in that
records the config and patches every RMSNorm instance with an equivalent forward, as liger's instance patching does.
"""

from __future__ import annotations

import types

import pytest
import torch
from trl import GRPOTrainer

from trl_plugins.testing import assert_runs_equal, digit_fraction_reward, make_tiny_trainer, record_run

LP_REG_ACTING = {"lp_reg": {"kappa": 0.5, "rho": 0.5}}


def _rms_norm_forward(self, hidden_states):
    dtype = hidden_states.dtype
    x = hidden_states.to(torch.float32)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
    return self.weight * x.to(dtype)


@pytest.fixture
def liger_stand_in(monkeypatch):
    """``transformers.trainer.apply_liger_kernel`` replaced: records ``(config, patched modules)`` per call."""
    calls = []

    def apply(model, kernel_config):
        patched = 0
        for module in model.modules():
            if type(module).__name__.endswith("RMSNorm"):
                module.forward = types.MethodType(_rms_norm_forward, module)
                patched += 1
        calls.append((dict(kernel_config or {}), patched))

    monkeypatch.setattr("transformers.trainer.apply_liger_kernel", apply)
    return calls


def _run(**config):
    return record_run(make_tiny_trainer(reward_funcs=[digit_fraction_reward], **{"max_steps": 2, **config}))


def test_loss_plugin_trains_the_same_with_liger_layer_kernels(liger_stand_in):
    """lp_reg (advantage-stage head statistics, a loss-stage term on per-token log-probs) acting: the run with the
    layer kernels swapped in is the run without them; TRL handed the kernels a config without the fused loss."""
    plain = _run(plugins=["lp_reg"], plugin_config=LP_REG_ACTING)
    assert not liger_stand_in
    with_liger = _run(plugins=["lp_reg"], plugin_config=LP_REG_ACTING, use_liger_kernel=True)
    assert len(liger_stand_in) == 1
    config, patched = liger_stand_in[0]
    assert config.get("fused_linear_cross_entropy") is False
    assert patched > 0  # the stand-in did patch the model the run trained
    assert_runs_equal(plain, with_liger)
    fractions = [log["plugins/lp_reg/selected_token_fraction"] for log in with_liger.logs if "loss" in log]
    assert any(f > 0 for f in fractions)  # the plugin acted on the liger run's per-token log-probs


def test_no_plugins_matches_trl_with_liger(liger_stand_in):
    trl_run = record_run(make_tiny_trainer(GRPOTrainer, reward_funcs=[digit_fraction_reward], max_steps=1,
                                           use_liger_kernel=True))
    ours = _run(max_steps=1, use_liger_kernel=True)
    assert [c for c, _ in liger_stand_in] == [{"fused_linear_cross_entropy": False}] * 2
    assert_runs_equal(trl_run, ours)


@pytest.mark.parametrize("plugins", [[], ["lp_reg"]])
def test_fused_linear_cross_entropy_refused_with_trls_message(plugins):
    """TRL refuses the fused loss at construction; the plugin trainer does too, with TRL's message."""
    config = {"use_liger_kernel": True, "liger_kernel_config": {"fused_linear_cross_entropy": True}}
    with pytest.raises(ValueError, match="fused_linear_cross_entropy.*is not supported") as trl_error:
        make_tiny_trainer(GRPOTrainer, **config)
    with pytest.raises(ValueError) as ours:
        make_tiny_trainer(plugins=plugins, **config)
    assert str(trl_error.value) in str(ours.value)

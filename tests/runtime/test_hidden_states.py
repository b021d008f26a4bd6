"""The hidden-state service (ctx.hidden_states): the states of the requested layer match a direct forward with
output_hidden_states, position t is the state predicting completion token t, chunks hold at most
per_device_train_batch_size rows, head_logprobs matches the full-vocabulary log-softmax, and bad use is refused."""

import pytest
import torch

from trl_plugins import PluginError
from trl_plugins.runtime.hidden_states import HiddenStateService, layer_module
from trl_plugins.testing import make_advantage_context, make_tiny_trainer


def _batch(trainer, B=5, P=3, C=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    V = trainer.model.config.vocab_size
    completion_mask = torch.ones(B, C, dtype=torch.long)
    completion_mask[1, 2:] = 0
    return {
        "prompt_ids": torch.randint(3, V, (B, P), generator=g),
        "prompt_mask": torch.ones(B, P, dtype=torch.long),
        "completion_ids": torch.randint(3, V, (B, C), generator=g),
        "completion_mask": completion_mask,
    }


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    return make_tiny_trainer(per_device_train_batch_size=2, num_generations=2,
                             output_dir=str(tmp_path_factory.mktemp("hs")))


@pytest.mark.parametrize("layer", [-1, 0, 1])
def test_states_match_a_direct_forward(trainer, layer):
    out = _batch(trainer)
    sizes = []

    def reduce(chunk):
        sizes.append(chunk.hidden.size(0))
        return {"hidden": chunk.hidden.clone(), "mask": chunk.mask}

    got = HiddenStateService(trainer).run(out, reduce, layer=layer)
    assert sizes == [2, 2, 1]  # chunks of per_device_train_batch_size rows
    ids = torch.cat([out["prompt_ids"], out["completion_ids"]], 1)
    am = torch.cat([out["prompt_mask"], out["completion_mask"]], 1)
    with torch.no_grad():
        ref = trainer.model(input_ids=ids, attention_mask=am, output_hidden_states=True).hidden_states[layer]
    P, C = out["prompt_ids"].size(1), out["completion_ids"].size(1)
    torch.testing.assert_close(got["hidden"], ref[:, P - 1:P - 1 + C], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got["mask"], out["completion_mask"])


def test_head_logprobs_match_the_full_log_softmax(trainer):
    out = _batch(trainer, seed=1)
    vocab = torch.tensor([3, 7, 11])
    got = HiddenStateService(trainer).run(out, lambda chunk: chunk.head_logprobs(vocab), layer=-1, head=True)
    ids = torch.cat([out["prompt_ids"], out["completion_ids"]], 1)
    am = torch.cat([out["prompt_mask"], out["completion_mask"]], 1)
    with torch.no_grad():
        logits = trainer.model(input_ids=ids, attention_mask=am).logits
    P, C = out["prompt_ids"].size(1), out["completion_ids"].size(1)
    ref = torch.log_softmax(logits[:, P - 1:P - 1 + C].float() / trainer.temperature, -1)[..., vocab]
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def test_bad_layer_and_undeclared_use_are_refused(trainer):
    n = len(trainer.model.model.layers)
    with pytest.raises(PluginError, match=f"hidden-state layer {n + 1} is out of range"):
        layer_module(trainer.model, n + 1)
    ctx = make_advantage_context(torch.tensor([1.0, 0.0]), num_generations=2)
    with pytest.raises(PluginError, match="without declaring needs_hidden_states = True"):
        ctx.hidden_states(lambda chunk: None)
    ctx = make_advantage_context(torch.tensor([1.0, 0.0]), num_generations=2, hidden_states=lambda *a: None)
    with pytest.raises(PluginError, match="allowed: -1"):
        ctx.hidden_states(lambda chunk: None, layer=1, head=True)

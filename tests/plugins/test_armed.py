"""armed (ARMed, reconstructed rescaling): answer extraction and the per-group min-max rescaling by hand (a collapsed
band of similarities is spread over [0, 1]); the reward hook with a scripted OpenAI-compatible /v1/embeddings server
on loopback and with a tiny local encoder loaded by path; a dead server is an error naming its URL; bad options are
refused; alpha = 0 is vanilla TRL; a tiny run trains."""

import math
import re

import pytest
import torch

from trl_plugins import PluginConfigError, build_plugins
from trl_plugins.components import serve_openai_compatible
from trl_plugins.components.client import EndpointError
from trl_plugins.testing import assert_reduces_to_vanilla, make_reward_context, make_tiny_trainer, stub_rows
from trl_plugins_builtin.armed import HFEmbedder, answer_text, rescale_similarities

PATTERN = re.compile(r"<answer>(.*?)</answer>")


def _vector(text):
    """A scripted embedding: letter counts (a..z), so texts with the same letters point the same way."""
    v = [0.0] * 26
    for ch in text.lower():
        if "a" <= ch <= "z":
            v[ord(ch) - 97] += 1.0
    return v if any(v) else [1.0] + [0.0] * 25


def _embedding_handler(seen):
    def handler(path, payload):
        seen.append((path, payload["model"], list(payload["input"])))
        return {"data": [{"index": i, "embedding": _vector(t)} for i, t in enumerate(payload["input"])]}

    return handler


@pytest.fixture(scope="module")
def encoder_path(tmp_path_factory):
    from trl_plugins.testing import tiny_model, tiny_tokenizer

    path = tmp_path_factory.mktemp("encoder")
    tok = tiny_tokenizer()
    tiny_model(tok).save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def test_answer_text_and_rescaling_by_hand():
    assert answer_text("think <answer> pneumonia </answer> done", PATTERN) == "pneumonia"
    assert answer_text("no tags here", PATTERN) == "no tags here"
    assert answer_text("<answer>x</answer>", None) == "<answer>x</answer>"
    # a collapsed band: 0.90 .. 0.93 is stretched over [0, 1]; a group of equal answers keeps its clamped similarity
    s = torch.tensor([0.90, 0.91, 0.93, 0.92, 0.5, 0.5, 0.5, 0.5], dtype=torch.float64)
    out = rescale_similarities(s, 4, "group_minmax", 1e-6)
    assert out.tolist() == pytest.approx([0.0, 1 / 3, 1.0, 2 / 3, 0.5, 0.5, 0.5, 0.5])
    assert rescale_similarities(torch.tensor([-0.2, 1.3]), 2, "none", 1e-6).tolist() == pytest.approx([0.0, 1.0])
    assert rescale_similarities(s[:4], 4, "group_minmax", 0.1).tolist() == pytest.approx(s[:4].tolist())


def test_reward_hook_with_a_loopback_embeddings_endpoint():
    seen = []
    completions = ["<answer>cat</answer>", "<answer>act</answer>", "<answer>dog</answer>", "<answer>cot</answer>"]
    rows = stub_rows(2, 2, answer=["cat", "dog"])
    with serve_openai_compatible(_embedding_handler(seen)) as url:
        plugin = build_plugins(["armed"], {"armed": {"embedder_base_url": url, "embedder_model": "emb"}}).plugins[0]
        ctx = make_reward_context([[1.0, 0.0], [0.0, 0.0], [1.0, 0.0], [0.0, 0.0]], num_generations=2,
                                  reward_func_names=["acc", "armed"], completions=completions, rows=rows)
        ctx.set_active_plugin("armed")
        plugin.trl_plugins_transform_rewards(ctx)
    assert seen and seen[0][0].endswith("/embeddings") and seen[0][1] == "emb"
    assert seen[0][2] == ["cat", "act", "dog", "cot", "cat", "cat", "dog", "dog"]  # answers, then references
    # group 1: "cat" and "act" are both identical to "cat" (spread 0: raw 1.0); group 2: "dog" 1.0, "cot" 1/3
    assert ctx.rewards_per_func[:, 1].tolist() == pytest.approx([1.0, 1.0, 1.0, 0.0])
    assert ctx.rewards_per_func[:, 0].tolist() == [1.0, 0.0, 1.0, 0.0]
    assert ctx.metrics["plugins/armed/similarity_spread"] == pytest.approx([(0.0 + 2 / 3) / 2])


def test_dead_endpoint_is_an_error_naming_the_url():
    url = "http://127.0.0.1:9/v1"
    plugin = build_plugins(["armed"], {"armed": {"embedder_base_url": url, "embedder_max_retries": 0,
                                                 "embedder_timeout": 2.0}}).plugins[0]
    ctx = make_reward_context([[1.0, 0.0], [0.0, 0.0]], num_generations=2, reward_func_names=["acc", "armed"],
                              completions=["a", "b"], rows=stub_rows(1, 2, answer=["a"]))
    with pytest.raises(EndpointError, match="127.0.0.1:9/v1/embeddings"):
        plugin.trl_plugins_transform_rewards(ctx)


def test_local_encoder_that_cannot_load_is_one_error_naming_it(tmp_path):
    missing = str(tmp_path / "no-encoder-here")
    with pytest.raises(EndpointError, match=r"Could not load the embedding model '.*no-encoder-here'"):
        HFEmbedder(missing)


def test_local_encoder_by_path(encoder_path):
    embedder = HFEmbedder(encoder_path, batch_size=2)
    vectors = embedder.embed(["12", "12", "345"])
    assert vectors.shape == (3, 32)
    assert torch.nn.functional.cosine_similarity(vectors[0], vectors[1], dim=0) == pytest.approx(1.0, abs=1e-5)
    plugin = build_plugins(["armed"], {"armed": {"embedder": "hf", "embedder_model": encoder_path,
                                                 "answer_pattern": r"Answer:\s*(\S+)"}}).plugins[0]
    ctx = make_reward_context([[0.0, 0.0]] * 4, num_generations=2, reward_func_names=["acc", "armed"],
                              completions=["Answer: 12", "Answer: 7", "Answer: 3", "Answer: 3"],
                              rows=stub_rows(2, 2, answer=["12", "3"]))
    ctx.set_active_plugin("armed")
    plugin.trl_plugins_transform_rewards(ctx)
    values = ctx.rewards_per_func[:, 1].tolist()
    assert values[0] == pytest.approx(1.0) and values[1] == pytest.approx(0.0)  # exact answer on top of its group
    assert all(0.0 <= v <= 1.0 and not math.isnan(v) for v in values)


def test_bad_options_are_refused():
    with pytest.raises(PluginConfigError, match="embedder='endpoint' needs embedder_base_url"):
        build_plugins(["armed"])
    with pytest.raises(PluginConfigError, match="embedder='hf' needs embedder_model"):
        build_plugins(["armed"], {"armed": {"embedder": "hf"}})
    with pytest.raises(PluginConfigError, match="'answer_pattern' of plugin 'armed' got '<answer>\\('"):
        build_plugins(["armed"], {"armed": {"embedder": "hf", "embedder_model": "m", "answer_pattern": "<answer>("}})
    with pytest.raises(PluginConfigError, match="'alpha' of plugin 'armed' got -1"):
        build_plugins(["armed"], {"armed": {"embedder": "hf", "embedder_model": "m", "alpha": -1.0}})
    with pytest.raises(PluginConfigError, match="'rescale' of plugin 'armed' got 'zscore'"):
        build_plugins(["armed"], {"armed": {"embedder": "hf", "embedder_model": "m", "rescale": "zscore"}})


def test_neutral_alpha_reduces_to_vanilla():
    # alpha = 0: no embedding call, so the model path is never loaded
    runs = assert_reduces_to_vanilla("armed", {"alpha": 0.0, "embedder": "hf", "embedder_model": "never-loaded"},
                                     loss_types=("dapo",), steps=1)
    assert runs["dapo"].logs


def test_tiny_run_trains_with_the_semantic_column(tmp_path, encoder_path):
    options = {"embedder": "hf", "embedder_model": encoder_path, "answer_pattern": r"Answer:\s*(\S+)"}
    trainer = make_tiny_trainer(plugins=["armed"], plugin_config={"armed": options}, max_steps=1,
                                output_dir=str(tmp_path))
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    assert any(not torch.equal(before[n], p) for n, p in trainer.model.named_parameters())
    logs = {k: v for entry in trainer.state.log_history for k, v in entry.items()}
    assert "plugins/armed/similarity_mean" in logs and 0.0 <= logs["rewards/armed/mean"] <= 1.0

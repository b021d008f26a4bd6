"""Tests of the tiny offline model: tokenizer, chat template, model, save/load by path, warm start, evaluation."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM, AutoTokenizer

from trl_plugins.tasks.arithmetic import (
    feedback,
    first_error_step,
    make_dataset,
    make_problem,
    make_rubrics,
    rubric_verdict,
    verify,
)
from trl_plugins.tasks.tiny import (
    CHAT_TEMPLATE,
    INFORMAL_ENDINGS,
    DemoSettings,
    build_and_save,
    build_tiny_model,
    build_tokenizer,
    demo_model,
    evaluate_accuracy,
    generate_completions,
    sft_loss,
    warm_start,
)


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tensors this small are fastest on one thread (and two threads crawl when the other core is busy)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


# --------------------------------------------------------------------------------------------------- tokenizer


@settings(max_examples=100, deadline=None)
@given(st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=126) | st.just("\n"), max_size=80))
def test_ascii_round_trip_is_one_token_per_character(text):
    tok = build_tokenizer()
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text)
    assert tok.decode(ids) == text


def test_special_tokens(tokenizer):
    assert tokenizer.pad_token == "<pad>" and tokenizer.eos_token == "<|end|>" and tokenizer.unk_token == "<unk>"
    assert len({tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.unk_token_id}) == 3
    for marker in ("<|system|>", "<|user|>", "<|assistant|>"):
        ids = tokenizer(marker, add_special_tokens=False)["input_ids"]
        assert len(ids) == 1 and ids[0] != tokenizer.unk_token_id
    assert tokenizer.padding_side == "left"


def test_unknown_characters_map_to_unk(tokenizer):
    ids = tokenizer("3é4\t", add_special_tokens=False)["input_ids"]
    assert len(ids) == 4
    assert ids[1] == ids[3] == tokenizer.unk_token_id
    assert tokenizer.decode(ids, skip_special_tokens=True) == "34"


def test_chat_template_renders_roles_and_generation_prompt(tokenizer):
    convo = [
        {"role": "system", "content": "Be exact."},
        {"role": "user", "content": "Compute 3+4 step by step (left to right)."},
        {"role": "assistant", "content": "3+4=7\nAnswer: 7"},
        {"role": "user", "content": "Again."},
    ]
    text = tokenizer.apply_chat_template(convo, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|system|>Be exact.<|user|>Compute 3+4 step by step (left to right)."
        "<|assistant|>3+4=7\nAnswer: 7<|end|><|user|>Again.<|assistant|>"
    )
    no_prompt = tokenizer.apply_chat_template(convo[:2], tokenize=False, add_generation_prompt=False)
    assert not no_prompt.endswith("<|assistant|>")
    with pytest.raises(Exception, match="unsupported role"):
        tokenizer.apply_chat_template([{"role": "tool", "content": "x"}], tokenize=False)


def test_chat_template_batch_like_trl(tokenizer):
    # Exactly the call GRPOTrainer makes for conversational prompts.
    prompts = [row for row in make_dataset(3, seed=0)["prompt"]]
    out = tokenizer.apply_chat_template(
        conversation=prompts, add_generation_prompt=True, tokenize=True, return_dict=True
    )
    assert len(out["input_ids"]) == 3
    for ids, prompt in zip(out["input_ids"], prompts):
        question = prompt[0]["content"]
        assert len(ids) == len(question) + 2  # <|user|> + one token per character + <|assistant|>
        assert tokenizer.decode(ids, skip_special_tokens=True) == question
        assert ids[-1] == tokenizer.convert_tokens_to_ids("<|assistant|>")
    assert tokenizer.chat_template == CHAT_TEMPLATE


# ------------------------------------------------------------------------------------------------------- model


def test_model_forward_and_generate_shapes(tokenizer):
    model = build_tiny_model(tokenizer, seed=0, hidden_size=32, num_layers=1)
    assert model.config.vocab_size == len(tokenizer)
    assert model.config.eos_token_id == model.generation_config.eos_token_id == tokenizer.eos_token_id
    assert model.config.pad_token_id == model.generation_config.pad_token_id == tokenizer.pad_token_id
    ids = torch.randint(3, len(tokenizer), (2, 7))
    assert model(input_ids=ids).logits.shape == (2, 7, len(tokenizer))
    enc = tokenizer.apply_chat_template(
        [[{"role": "user", "content": "Compute 1+2 step by step."}], [{"role": "user", "content": "Hi"}]],
        add_generation_prompt=True, tokenize=True, return_dict=True, padding=True, return_tensors="pt",
    )
    out = model.generate(**enc, max_new_tokens=5, do_sample=False)
    assert out.shape[0] == 2 and enc["input_ids"].shape[1] < out.shape[1] <= enc["input_ids"].shape[1] + 5


def test_model_init_is_seeded(tokenizer):
    a = build_tiny_model(tokenizer, seed=1, hidden_size=16, num_layers=1)
    b = build_tiny_model(tokenizer, seed=1, hidden_size=16, num_layers=1)
    c = build_tiny_model(tokenizer, seed=2, hidden_size=16, num_layers=1)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not all(torch.equal(sa[k], sc[k]) for k in sa)


def test_save_and_load_by_path(tmp_path, tokenizer):
    path = build_and_save(tmp_path / "tiny", seed=3, hidden_size=32, num_layers=1)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    reference = build_tiny_model(tokenizer, seed=3, hidden_size=32, num_layers=1)
    assert tok.chat_template == CHAT_TEMPLATE
    assert (tok.eos_token, tok.pad_token, tok.unk_token) == ("<|end|>", "<pad>", "<unk>")
    text = "<|user|>Compute 3+4*2 step by step (left to right).<|assistant|>3+4=7"
    assert tok(text)["input_ids"] == tokenizer(text)["input_ids"]
    assert model.generation_config.eos_token_id == tokenizer.eos_token_id
    ids = torch.tensor([tokenizer(text)["input_ids"]])
    torch.testing.assert_close(model(input_ids=ids).logits, reference(input_ids=ids).logits)


# ----------------------------------------------------------------------------------------- warm start / eval


def test_warm_start_reduces_the_sft_loss_and_is_deterministic(tokenizer):
    rng = random.Random(123)
    held_out = [make_problem(rng, 1) for _ in range(32)]

    def trained():
        model = build_tiny_model(tokenizer, seed=0, hidden_size=32, num_layers=1)
        before = sft_loss(model, tokenizer, held_out)
        warm_start(model, tokenizer, levels=(1,), steps=30, seed=0, lr=1e-2, batch_size=16, warmup_steps=5)
        return model, before, sft_loss(model, tokenizer, held_out)

    model, before, after = trained()
    assert after < 0.6 * before
    assert not model.training
    _, _, again = trained()
    assert again == pytest.approx(after, abs=1e-5)


def test_warm_start_validates_informal_fraction(tokenizer):
    model = build_tiny_model(tokenizer, seed=0, hidden_size=16, num_layers=1)
    with pytest.raises(ValueError, match="informal_fraction"):
        warm_start(model, tokenizer, steps=1, informal_fraction=1.5)
    with pytest.raises(ValueError, match="level 2"):
        warm_start(model, tokenizer, levels=(1, 2), steps=1, informal_fraction={1: 0.5, 2: -0.1})


@pytest.mark.parametrize("ending", INFORMAL_ENDINGS)
def test_informal_endings_are_rejected_by_the_verifier_only_for_their_format(ending):
    # The demo's warm start relies on this: right steps, informal last line => reward 0, and the PRM,
    # feedback and rubric judge all point at the last line's format, not at the arithmetic.
    p = make_problem(random.Random(0), 2)
    text = "\n".join([*p.step_lines, ending.format(p.answer)])
    assert not verify(text, p.answer)
    assert first_error_step(p, text) == len(p.steps)
    assert "Answer: N" in feedback(p, text)
    verdicts = {it["tags"][0]: rubric_verdict(it, p, text) for it in make_rubrics(p)}
    assert verdicts["kind:all_steps"] and not verdicts["kind:format"] and not verdicts["kind:final_answer"]


class _Oracle(torch.nn.Module):
    """Stands in for a model: ``generate`` appends scripted completions (tests the evaluation plumbing)."""

    def __init__(self, tokenizer, completions):
        super().__init__()
        self.tokenizer, self.completions = tokenizer, list(completions)
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.calls = []

    def generate(self, input_ids, attention_mask, num_return_sequences, **kwargs):
        self.calls.append(kwargs)
        n = input_ids.shape[0] * num_return_sequences
        texts, self.completions = self.completions[:n], self.completions[n:]
        rows = [self.tokenizer(t + "<|end|>", add_special_tokens=False)["input_ids"] for t in texts]
        width = max(map(len, rows))
        tail = torch.tensor([r + [self.tokenizer.pad_token_id] * (width - len(r)) for r in rows])
        return torch.cat([input_ids.repeat_interleave(num_return_sequences, 0), tail], dim=1)


def test_evaluate_accuracy_counts_verified_completions(tokenizer):
    ds = make_dataset(4, seed=0)
    answers = ds["answer"]
    scripted = [f"Answer: {answers[0]}", "Answer: -1", ds["solution"][2], "3+4=7"]
    assert evaluate_accuracy(_Oracle(tokenizer, scripted), tokenizer, ds, batch_size=3) == 0.5
    sampled = [f"Answer: {a}" if i % 2 == 0 else "nope" for a in answers for i in range(4)]
    oracle = _Oracle(tokenizer, sampled)
    assert evaluate_accuracy(oracle, tokenizer, ds, temperature=1.0, num_samples=4) == 0.5
    assert oracle.calls[0]["do_sample"] is True and oracle.calls[0]["temperature"] == 1.0


def test_generation_helpers_on_a_real_model(tokenizer):
    model = build_tiny_model(tokenizer, seed=0, hidden_size=32, num_layers=1)
    ds = make_dataset(3, seed=0)
    texts = generate_completions(model, tokenizer, [p[0]["content"] for p in ds["prompt"]], max_new_tokens=6)
    assert len(texts) == 3 and all(len(t) <= 6 for t in texts)
    sampled = generate_completions(model, tokenizer, ["Hi"], max_new_tokens=4, temperature=1.0, num_samples=5)
    assert len(sampled) == 5
    acc = evaluate_accuracy(model, tokenizer, ds, max_new_tokens=6)
    assert acc == sum(verify(t, a) for t, a in zip(texts, ds["answer"])) / 3
    with pytest.raises(ValueError, match="greedy"):
        generate_completions(model, tokenizer, ["Hi"], temperature=0.0, num_samples=2)


# ------------------------------------------------------------------------------------------------- demo model


def test_demo_model_caches_by_settings(tmp_path, capsys):
    small = dataclasses.replace(
        DemoSettings(), hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32, warm_start_steps=3,
        warm_start_batch_size=4,
    )
    model, tok = demo_model(tmp_path, small, progress=True)
    err = capsys.readouterr().err
    assert "[builtin:tiny] first use: warm-starting the tiny model into" in err and "once per machine" in err
    assert "warm-starting builtin:tiny" in err and "3/3" in err  # the progress bar ran to the end
    entries = [e for e in tmp_path.iterdir() if not e.name.startswith(".")]  # (and the lock file)
    assert [e.name for e in entries] == [f"tiny-{small.cache_key()}"]
    again, tok2 = demo_model(tmp_path, small, progress=True)  # loaded by path, not retrained
    assert "first use" not in capsys.readouterr().err  # nothing to announce
    ids = torch.tensor([tok("<|user|>Compute 1+2<|assistant|>")["input_ids"]])
    torch.testing.assert_close(model(input_ids=ids).logits, again(input_ids=ids).logits)
    assert tok2.chat_template == tok.chat_template
    other = dataclasses.replace(small, warm_start_steps=4)
    assert other.cache_key() != small.cache_key()
    assert dataclasses.replace(small, grpo_steps=1).cache_key() == small.cache_key()  # GRPO settings don't matter

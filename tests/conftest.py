"""Shared test setup: the trl-plugins testing kit's fixtures (tiny model, tokenizer, tasks, trainer factory)."""

import os
import warnings

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Under pytest-xdist (`-n N`) the workers share the cores: each takes its share of torch's intra-op threads instead of
# all of them (oversubscribed threads spin and slow every worker down). OMP_NUM_THREADS, when set, wins.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT") and "OMP_NUM_THREADS" not in os.environ:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))
warnings.filterwarnings("ignore", message=".*gemm_4bit.*")

pytest_plugins = ["trl_plugins.testing"]


@pytest.fixture(scope="session")
def loss_batch():
    """``loss_batch(trainer)``: one generation batch of ``trainer`` for direct ``trainer._compute_loss`` calls, with
    rows of unequal lengths (T, T-2, T-4, ...) and old log-probs that move every row's importance ratio (per row
    and per token, some rows and tokens outside the clip range), so that surrogates, clip metrics and
    sequence-level weights all have signal. Puts the trainer in training mode with one accumulation step."""

    def build(trainer, seed: int = 0) -> dict:
        trainer.model.train()
        trainer.current_gradient_accumulation_steps = 1  # set by Trainer's training loop otherwise
        rows = [dict(trainer.train_dataset[0]) for _ in range(trainer.num_generations)]
        inputs = trainer._generate_and_score_completions(rows)
        mask = inputs["completion_mask"].clone()
        B, T = mask.shape
        for row in range(B):
            mask[row, T - 2 * row:] = 0
        input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
        attention = torch.cat([inputs["prompt_mask"], mask], dim=1)
        with torch.no_grad():
            logps, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, input_ids, attention, T)
        g = torch.Generator().manual_seed(seed)
        shift = torch.linspace(-0.4, 0.4, B).unsqueeze(1) + 0.3 * torch.randn(logps.shape, generator=g)
        return dict(inputs, completion_mask=mask, num_items_in_batch=mask.sum(), old_per_token_logps=logps + shift)

    return build

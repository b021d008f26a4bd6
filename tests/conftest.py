"""Shared test setup: the trl-plugins testing kit's fixtures (tiny model, tokenizer, tasks, trainer factory)."""

import os
import warnings

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
warnings.filterwarnings("ignore", message=".*gemm_4bit.*")

pytest_plugins = ["trl_plugins.testing"]

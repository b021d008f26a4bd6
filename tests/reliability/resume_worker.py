"""Worker of the SIGKILL / resume test (``test_resume_sigkill.py``); not collected by pytest.

``python resume_worker.py OUT_DIR BLOCK_AT`` trains the run of :func:`build_trainer` (checkpoint every step) and, when
the generation of the step after ``global_step == BLOCK_AT`` scores its completions, writes ``OUT_DIR/blocked`` and
sleeps: the test then kills it with SIGKILL, in the middle of a training step, after checkpoint ``BLOCK_AT``.

The stack holds every kind of resumable state: ``adaptive_sampler`` (per-prompt history, pending outcomes; it replaces
the training sampler), ``laser`` (LASER-D's history of lengths and targets), ``clip_cov`` (a random generator) and ``hint_scaffold``
(no state of its own, but its extra rollouts move the framework's generation-service counter).
"""

from __future__ import annotations

import os
import sys
import time

MAX_STEPS = 4
BLOCK_ENV = "TRL_PLUGINS_TEST_BLOCK_AT"
PLUGINS = ["adaptive_sampler", "hint_scaffold", "laser", "clip_cov"]
PLUGIN_CONFIG = {
    "adaptive_sampler": {"success_threshold": 0.2, "variance_mix": 0.5, "prune_solved": False},
    "hint_scaffold": {"success_threshold": 0.9, "replace": "one", "hint_fractions": [0.5]},
    "clip_cov": {"ratio": 0.2},
}


def blocking_digit_reward(completions, trainer_state=None, **kwargs):
    """The digit-fraction reward; blocks (forever, for the test) at the step named by ``$TRL_PLUGINS_TEST_BLOCK_AT``."""
    from trl_plugins.testing import digit_fraction_reward

    block_at = os.environ.get(BLOCK_ENV)
    if block_at is not None and trainer_state is not None and trainer_state.global_step == int(block_at):
        with open(os.path.join(os.environ["TRL_PLUGINS_TEST_OUT"], "blocked"), "w") as f:
            f.write(str(trainer_state.global_step))
        time.sleep(3600)
    return digit_fraction_reward(completions)


blocking_digit_reward.__name__ = "digit_fraction_reward"


def build_trainer(out_dir: str, max_steps: int = MAX_STEPS, plugins: list[str] | None = None):
    from trl_plugins.tasks.arithmetic import accuracy_reward
    from trl_plugins.testing import make_tiny_trainer, tiny_dataset

    plugins = PLUGINS if plugins is None else plugins
    return make_tiny_trainer(
        plugins=plugins,
        plugin_config={k: v for k, v in PLUGIN_CONFIG.items() if k in plugins},
        reward_funcs=[accuracy_reward, blocking_digit_reward],
        dataset=tiny_dataset(8),
        output_dir=out_dir,
        max_steps=max_steps,
        save_strategy="steps",
        save_steps=1,
        log_level="error",
        loss_type="dr_grpo",
        max_completion_length=8,
    )


def main(argv: list[str]) -> None:
    import torch

    torch.set_num_threads(1)
    out_dir, block_at = argv[0], argv[1]
    os.environ[BLOCK_ENV] = block_at
    os.environ["TRL_PLUGINS_TEST_OUT"] = out_dir
    build_trainer(out_dir).train()


if __name__ == "__main__":
    main(sys.argv[1:])

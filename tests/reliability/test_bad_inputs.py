"""Bad inputs, one table: each case is (input, the stage it must fail at, the message it must contain).

Stages:

* ``config`` -- ``PluginGRPOConfig(...)`` (the Python API) raises a ``PluginError`` while the config is built;
* ``cli`` -- ``trl-plugins train CONFIG.yaml [overrides]`` exits with status 2 and ``trl-plugins: error: ...`` before a
  model is loaded (``load_model`` is replaced by a function that fails the test);
* ``stack`` -- the plugins' construction (``build_stack``: options validated, ``trl_plugins_configure`` called, as the
  trainer does);
* ``trainer`` -- ``PluginGRPOTrainer(...)`` on the kit's tiny model raises (data checked before any step);
* ``env`` -- plugin discovery under an environment variable;
* ``resume`` -- loading a checkpoint's plugin state;
* ``compare`` -- ``trl-plugins compare CONFIG.yaml [flags]`` exits with status 2 and ``trl-plugins: error: ...``
  before any run starts (``run_one`` is replaced by a function that fails the test);
* ``row`` -- a value that only exists at run time (a reward function's answer for one row): refused when the reward
  stage (``_calculate_rewards``) meets the first row that carries it, naming the function and the row.

Each stage is one *class* in docs/reliability.md's generated table (:data:`CLASSES`; ``python -m trl_plugins.cli.docs``
writes it, ``tests/cli/test_docs.py`` fails when it is stale).

A case whose message starts with ``warn:`` must warn (not fail) with that message. Two groups of cases are generated
from the built-in plugins' option schemas, so the table grows with every plugin: a non-finite value for every float
option, and a misspelt key for every plugin. No case trains.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import yaml
from datasets import Dataset

from trl_plugins import PluginError, PluginGRPOConfig
from trl_plugins.runtime.checkpoints import PLUGIN_STATE_FILE
from trl_plugins.cli import main
from trl_plugins.runtime.manager import available_plugins, builtin_modules
from trl_plugins.testing import (
    build_stack,
    digit_fraction_reward,
    make_tiny_trainer,
    tiny_dataset,
)


class _Planted:
    """A pickled object whose unpickling would run a command (refused before it runs: weights_only)."""

    def __reduce__(self):
        import os

        return (os.system, ("exit 0",))


class _Plain:
    """A harmless class instance: still not plugin state (unpickling classes can run code)."""


class _NoToolEnvironment:
    """An environment TRL accepts (it has reset) that offers the model no tool."""

    def reset(self, **row):
        return None

    def get_reward(self):
        return 0.0


@dataclass(frozen=True)
class Case:
    id: str
    stage: str  # config | cli | stack | trainer | env | resume | compare | row
    input: Any
    message: str


BASE_YAML = {"model_name_or_path": "builtin:tiny", "report_to": "none", "use_cpu": True, "max_steps": 1}
RUSCARL_ENDPOINT = {"judge": "endpoint", "judge_model": "m"}


# ============================================================================================ cases
def _config(**fields):
    return fields


CASES = [
    # ---------------------------------------------------------------- plugin names and plugins / plugin_config shapes
    Case("unknown-plugin", "config", _config(plugins=["hint_scafold"]), "Did you mean 'hint_scaffold'"),
    Case("upper-case-plugin", "config", _config(plugins=["LP_REG"]), "Did you mean 'lp_reg'? (plugin names are lower"),
    Case("mixed-case-plugin", "config", _config(plugins=["Canon"]), "Did you mean 'canon'?"),
    Case("dashed-plugin", "config", _config(plugins=["lp-reg"]), "Did you mean 'lp_reg'"),
    Case("plugin-name-not-a-string", "config", _config(plugins=[3]), "plugins must hold plugin names (strings); got 3"),
    Case("plugin-name-a-mapping-in-a-list", "config", _config(plugins=[{"lp_reg": {"kappa": 0.1}}]),
         "write plugins as a mapping {name: {option: value}}"),
    Case("plugins-an-integer", "config", _config(plugins=5), "plugins must be a list of plugin names"),
    Case("plugin-twice", "config", _config(plugins=["canon", "canon"]), "Plugin 'canon' is enabled twice"),
    Case("plugins-mapping-bad-type", "config", _config(plugins={"lp_reg": {"kappa": "high"}}),
         "Option 'kappa' of plugin 'lp_reg' got 'high'; allowed: a number"),
    Case("plugins-mapping-unknown-option", "config", _config(plugins={"lp_reg": {"bogus": 1}}),
         "Unknown option 'bogus' for plugin 'lp_reg'"),
    Case("plugins-mapping-options-not-a-mapping", "config", _config(plugins={"lp_reg": 0.02}),
         "plugins['lp_reg'] must be a mapping of option names to values"),
    Case("plugins-mapping-unknown-plugin", "config", _config(plugins={"lpreg": {"kappa": 0.1}}),
         "Unknown plugin 'lpreg'. Did you mean 'lp_reg'"),
    Case("options-given-twice", "config",
         _config(plugins={"lp_reg": {"kappa": 0.1}}, plugin_config={"lp_reg": {"kappa": 0.2}}),
         "Options for plugin 'lp_reg' are given twice"),
    Case("plugin-config-number", "config", _config(plugins=["lp_reg"], plugin_config={"lp_reg": 0.02}),
         "plugin_config['lp_reg'] must be a mapping of option names to values (e.g. plugin_config: {lp_reg: {kappa: "),
    Case("plugin-config-list-of-pairs", "config", _config(plugins=["lp_reg"], plugin_config={"lp_reg": ["kappa", 0.02]}),
         "got ['kappa', 0.02] (list)"),
    Case("plugin-config-a-list", "config", _config(plugins=["lp_reg"], plugin_config=[{"lp_reg": {}}]),
         "plugin_config must be a mapping from plugin name to its options"),
    Case("plugin-config-integer-key", "config", _config(plugins=["lp_reg"], plugin_config={1: {"kappa": 0.1}}),
         "plugin_config keys must be plugin names (strings); got 1 (int)"),
    Case("plugin-config-bad-json", "config", _config(plugins=["lp_reg"], plugin_config="{lp_reg: {kappa: 0.1}}"),
         "plugin_config is not valid JSON"),
    Case("plugin-config-json-list", "config", _config(plugins=["lp_reg"], plugin_config="[1, 2]"),
         "plugin_config must be a mapping from plugin name to its options"),
    Case("plugin-config-for-plugin-not-enabled", "config", _config(plugins=["canon"], plugin_config={"lp_reg": {}}),
         "plugin_config has options for 'lp_reg', which is not in plugins=['canon']"),
    Case("plugin-config-misspelt-plugin", "config", _config(plugins=["lp_reg"], plugin_config={"lp_rge": {}}),
         "Did you mean 'lp_reg'? Enable it in `plugins`"),
    # ---------------------------------------------------------------- option values
    Case("option-nan", "config", _config(plugins=["lp_reg"], plugin_config={"lp_reg": {"kappa": math.nan}}),
         "Option 'kappa' of plugin 'lp_reg' got nan; allowed: a finite number (> 0.0 and <= 1.0)"),
    Case("option-inf", "config", _config(plugins=["canon"], plugin_config={"canon": {"alpha": math.inf}}),
         "Option 'alpha' of plugin 'canon' got inf; allowed: a finite number"),
    Case("option-minus-inf", "config", _config(plugins=["lp_reg"], plugin_config={"lp_reg": {"beta": -math.inf}}),
         "got -inf; allowed: a finite number"),
    Case("option-nan-in-a-list", "config",
         _config(plugins=["hint_scaffold"], plugin_config={"hint_scaffold": {"hint_fractions": [0.5, math.nan]}}),
         "'hint_fractions[1]' of plugin 'hint_scaffold' got nan; allowed: a finite number"),
    Case("option-string-for-number", "config", _config(plugins=["lp_reg"], plugin_config={"lp_reg": {"kappa": "0.1"}}),
         "got '0.1'; allowed: a number"),
    Case("option-bool-for-number", "config", _config(plugins=["lp_reg"], plugin_config={"lp_reg": {"kappa": True}}),
         "got True; allowed: a number"),
    Case("option-float-for-int", "config",
         _config(plugins=["hint_scaffold"], plugin_config={"hint_scaffold": {"replace_index": 1.5}}),
         "got 1.5; allowed: an integer"),
    Case("option-strict-lower-bound", "config", _config(plugins=["lp_reg"], plugin_config={"lp_reg": {"kappa": 0.0}}),
         "got 0.0; allowed: a value > 0.0 and <= 1.0"),
    Case("option-above-max", "config", _config(plugins=["lp_reg"], plugin_config={"lp_reg": {"kappa": 1.5}}),
         "got 1.5; allowed: a value <= 1.0 and > 0.0"),
    Case("option-below-min", "config",
         _config(plugins=["hint_scaffold"], plugin_config={"hint_scaffold": {"replace_index": -1}}),
         "got -1; allowed: a value >= 0"),
    Case("option-not-a-choice", "config",
         _config(plugins=["lp_reg"], plugin_config={"lp_reg": {"threshold_mode": "maxp"}}), "'minp', 'fixed'"),
    Case("option-choice-wrong-case", "config",
         _config(plugins=["lp_reg"], plugin_config={"lp_reg": {"threshold_mode": "MINP"}}), "got 'MINP'"),
    Case("optional-option-wrong-type-says-or-none", "config",
         _config(plugins=["posterior_grpo"], plugin_config={"posterior_grpo": {"anneal_steps": "big"}}),
         "allowed: a number or None"),
    Case("optional-option-nan-says-or-none", "config",
         _config(plugins=["posterior_grpo"], plugin_config={"posterior_grpo": {"anneal_steps": math.nan}}),
         "allowed: a finite number or None"),
    Case("reasonflux-beta-one", "config",
         _config(plugins=["reasonflux_prm"], plugin_config={"reasonflux_prm": {"prm": "programmatic", "beta": 1.0}}),
         "allowed: 0 <= beta < 1"),
    Case("option-list-for-scalar", "config", _config(plugins=["lp_reg"], plugin_config={"lp_reg": {"kappa": [0.1]}}),
         "got [0.1]; allowed: a number"),
    Case("option-scalar-for-list", "config",
         _config(plugins=["hint_scaffold"], plugin_config={"hint_scaffold": {"hint_fractions": 0.5}}),
         "allowed: a list"),
    Case("option-bool-as-string", "config",
         _config(plugins=["hint_scaffold"], plugin_config={"hint_scaffold": {"swapped_as_offpolicy": "yes"}}),
         "allowed: true or false"),
    Case("incompatible-pair", "config", _config(plugins=["lp_reg", "clip_cov"]),
         "Plugins 'lp_reg' and 'clip_cov' cannot be stacked"),
    # ---------------------------------------------------------------- project fields and GRPOConfig fields
    Case("gamma-zero", "config", _config(offpolicy_shaping_gamma=0.0), "offpolicy_shaping_gamma must be a finite number"),
    Case("gamma-nan", "config", _config(offpolicy_shaping_gamma=math.nan), "got nan"),
    Case("gamma-inf", "config", _config(offpolicy_shaping_gamma=math.inf), "got inf"),
    Case("gamma-string", "config", _config(offpolicy_shaping_gamma="0.1"), "got '0.1'"),
    Case("chunk-zero", "config", _config(head_stats_chunk_size=0), "head_stats_chunk_size must be an integer >= 1"),
    Case("chunk-float", "config", _config(head_stats_chunk_size=2.5), "got 2.5"),
    Case("budget-negative", "config", _config(plugin_generation_budget=-1),
         "plugin_generation_budget must be an integer >= 0 or None"),
    Case("budget-float", "config", _config(plugin_generation_budget=1.5), "got 1.5"),
    Case("max-steps-zero", "config", _config(max_steps=0), "max_steps=0 trains nothing"),
    Case("output-dir-is-a-file", "config", _config(output_dir="{file}"), "is a file; it must be a directory"),
    Case("output-dir-below-a-file", "config", _config(output_dir="{file}/out"),
         "in its path is a file, not a folder"),
    Case("vllm-mode-without-vllm", "config", _config(vllm_mode="server"),
         "warn:only take effect with use_vllm=True"),
    Case("trl-own-check", "config", _config(per_device_train_batch_size=3, num_generations=2),
         "Invalid configuration: generation_batch_size (3) must be divisible by num_generations (2)"),
    # ---------------------------------------------------------------- the command line and the YAML file
    Case("yaml-unknown-key", "cli", {"max_step": 3}, "Unknown field 'max_step' in the config file"),
    Case("yaml-unknown-key-suggests", "cli", {"max_step": 3}, "Did you mean 'max_steps'"),
    Case("yaml-plugin-singular", "cli", {"plugin": ["lp_reg"]}, "Did you mean 'plugins'"),
    Case("yaml-plugin-config-typo", "cli", {"plugins": ["lp_reg"], "plugins_config": {}}, "'plugin_config'"),
    Case("yaml-reward-typo", "cli", {"reward_func": ["accuracy"]}, "Did you mean 'reward_funcs'"),
    Case("yaml-not-a-mapping", "cli", "[1, 2, 3]", "must hold a YAML mapping of fields"),
    Case("yaml-syntax-error", "cli", "plugins: [lp_reg\nmax_steps: 1\n", "Could not read the config file"),
    Case("yaml-plugins-mapping", "cli", {"plugins": {"lp_reg": {"kappa": "high", "bogus": 1}}},
         "Unknown option 'bogus' for plugin 'lp_reg'"),
    Case("yaml-plugin-config-number", "cli", {"plugins": ["lp_reg"], "plugin_config": {"lp_reg": 0.02}},
         "plugin_config['lp_reg'] must be a mapping"),
    Case("yaml-plugin-config-list", "cli", {"plugins": ["lp_reg"], "plugin_config": [1]},
         "plugin_config must be a mapping"),
    Case("yaml-plugin-config-int-key", "cli", {"plugins": ["lp_reg"], "plugin_config": {1: {}}},
         "plugin_config keys must be plugin names"),
    Case("yaml-nan-option", "cli", {"plugins": {"lp_reg": {"kappa": math.nan}}}, "got nan; allowed: a finite number"),
    Case("yaml-upper-case-plugin", "cli", {"plugins": ["LP_REG"]}, "Did you mean 'lp_reg'"),
    Case("yaml-gamma-zero", "cli", {"offpolicy_shaping_gamma": 0}, "offpolicy_shaping_gamma must be a finite number"),
    Case("yaml-chunk-zero", "cli", {"head_stats_chunk_size": 0}, "head_stats_chunk_size must be an integer >= 1"),
    Case("yaml-budget-negative", "cli", {"plugin_generation_budget": -1}, "plugin_generation_budget must be"),
    Case("yaml-max-steps-zero", "cli", {"max_steps": 0}, "max_steps=0 trains nothing"),
    Case("yaml-output-dir-file", "cli", {"output_dir": "{file}"}, "is a file; it must be a directory"),
    Case("yaml-trl-own-check", "cli", {"per_device_train_batch_size": 3},
         "Invalid configuration: generation_batch_size (3) must be divisible by num_generations"),
    Case("yaml-unknown-reward", "cli", {"reward_funcs": ["acuracy"]}, "Unknown reward function 'acuracy'. Did you mean"),
    Case("yaml-upper-case-reward", "cli", {"reward_funcs": ["Accuracy"]}, "Did you mean 'accuracy'"),
    Case("yaml-reward-module-missing", "cli", {"reward_funcs": ["no_such_pkg.rewards.r"]},
         "Could not import reward function 'no_such_pkg.rewards.r'"),
    Case("yaml-reward-attribute-missing", "cli", {"reward_funcs": ["trl_plugins.tasks.arithmetic.acuracy_reward"]},
         "has no function 'acuracy_reward'. Did you mean 'accuracy_reward'"),
    Case("yaml-dataset-missing-split", "cli", {"dataset_name": "{json}", "dataset_train_split": "training"},
         "has no split 'training'; splits: train"),
    Case("yaml-dataset-not-found", "cli", {"dataset_name": "{missing}"}, "Could not load dataset_name="),
    Case("cli-bad-json-override", "cli", ({"plugins": ["lp_reg"]}, ["--plugin_config", "{bad"]),
         "plugin_config is not valid JSON"),
    Case("cli-unknown-flag", "cli", ({}, ["--max_stesp", "3"]), "Unknown field 'max_stesp' on the command line"),
    Case("cli-misspelt-plugin-override", "cli", ({"plugins": ["canon"]}, ["--plugins", "lp_rge"]),
         "Did you mean 'lp_reg'"),
    # ---------------------------------------------------------------- plugins that need the run's settings / components
    Case("replace-index-beyond-group", "stack", ("hint_scaffold", {"replace": "one", "replace_index": 4}),
         "allowed: a slot of the group, 0 to 3 (num_generations=4)"),
    Case("urpo-verdicts-leave-one-answer", "stack", ("urpo", {"verdict_rows": 3}),
         "Plugin 'urpo': verdict_rows=3 with num_generations=4; allowed: 0 (untrained self-judgements) or 2 <="),
    Case("ettrl-branching-factor-zero", "stack", ("ettrl", {"branches": 0}),
         "Option 'branches' of plugin 'ettrl' got 0; allowed: a value >= 1"),
    Case("ettrl-tree-beyond-group", "stack", ("ettrl", {"fork_points": 2, "branches": 2}),
         "= 5 rollouts does not fit in a group of num_generations=4; allowed: num_generations >= 5"),
    Case("spo-tree-branching-factor-zero", "stack", ("spo", {"mode": "tree", "branch_factors": [6, 0, 6]}),
         "Option 'branch_factors' of plugin 'spo' got [6, 0, 6]; allowed: a non-empty list (one entry per depth) of "
         "branching factors >= 1"),
    Case("spo-tree-depth-zero", "stack", ("spo", {"mode": "tree", "branch_factors": []}),
         "Option 'branch_factors' of plugin 'spo' got []; allowed: a non-empty list"),
    Case("spo-tree-node-budget-below-depth", "stack", ("spo", {"mode": "tree", "max_nodes": 2}),
         "Option 'max_nodes' of plugin 'spo' got 2; allowed: None or at least the tree's depth 3"),
    Case("spo-tree-node-budget-below-group", "stack", ("spo", {"mode": "tree", "max_nodes": 3, "branch_factors": [2, 2]}),
         "Option 'max_nodes' of plugin 'spo' got 3, smaller than the group (num_generations=4); allowed: None or at "
         "least 4"),
    Case("spo-tree-leaves-below-group", "stack", ("spo", {"mode": "tree", "branch_factors": [3]}),
         "a tree of at most 3 leaves cannot fill a group of num_generations=4"),
    Case("latr-branching-factor-one", "stack", ("latr", {"max_branch_per_token": 1}),
         "Option 'max_branch_per_token' of plugin 'latr' got 1; allowed: a value >= 2"),
    Case("latr-lookahead-zero", "stack", ("latr", {"pruning_steps": [0, 20]}),
         "Option 'pruning_steps' of plugin 'latr' got [0, 20]; allowed: a non-empty list of lookahead lengths >= 1"),
    Case("deepsearch-width-zero", "stack", ("deepsearch", {"expansion_width": 0}),
         "Option 'expansion_width' of plugin 'deepsearch' got 0; allowed: a value >= 1"),
    Case("deepsearch-budget-below-group", "stack", ("deepsearch", {"node_budget": 3}),
         "Option 'node_budget' of plugin 'deepsearch' got 3; allowed: a budget >= num_generations=4"),
    Case("deepsearch-depth-beyond-length", "stack", ("deepsearch", {"max_depth": 13}),
         "Option 'max_depth' of plugin 'deepsearch' got 13; allowed: at most max_completion_length=12"),
    Case("rex-rag-probe-slots-fill-group", "stack", ("rex_rag", {"probe_slots": 4}),
         "Option 'probe_slots' of plugin 'rex_rag' got 4; allowed: 0 to 3 (num_generations=4"),
    Case("rex-rag-answer-pattern-not-regex", "stack", ("rex_rag", {"answer_pattern": "(<answer>"}),
         "Option 'answer_pattern' of plugin 'rex_rag' got '(<answer>', not a regular expression"),
    Case("arpo-roots-beyond-group", "stack", ("arpo", {"initial_rollouts": 5}),
         "Option 'initial_rollouts' of plugin 'arpo' got 5 with num_generations=4; allowed: 1 <= initial_rollouts <= "
         "num_generations"),
    Case("arpo-beam-size-zero", "stack", ("arpo", {"beam_size": 0}),
         "Option 'beam_size' of plugin 'arpo' got 0; allowed: a value >= 1"),
    Case("aepo-roots-beyond-group", "stack", ("aepo", {"branching": True, "dynamic_rollouts": False,
                                                     "initial_rollouts": 5}),
         "Option 'initial_rollouts' of plugin 'aepo' got 5 with num_generations=4; allowed: 1 <= initial_rollouts <= "
         "num_generations"),
    Case("aepo-roots-with-pre-monitoring", "stack", ("aepo", {"branching": True, "initial_rollouts": 2}),
         "Option 'initial_rollouts' of plugin 'aepo' got 2 with dynamic_rollouts=True; allowed: initial_rollouts=None "
         "with dynamic_rollouts=True"),
    Case("search-r2-revisions-negative", "stack", ("search_r2", {"max_revisions": -1}),
         "Option 'max_revisions' of plugin 'search_r2' got -1; allowed: a value >= 0"),
    Case("search-r2-template-unknown-field", "stack",
         ("search_r2", {"trimmer_template": "{question} {trajectory} {answer}"}),
         "Option 'trimmer_template' of plugin 'search_r2' got '{question} {trajectory} {answer}'; it has the field "
         "{answer}, which the plugin does not fill"),
    Case("slate-one-candidate-per-step", "stack", ("slate", {"prm": "programmatic", "k": 1}),
         "Option 'k' of plugin 'slate' got 1; allowed: a value >= 2"),
    Case("slate-k-not-dividing-group", "stack", ("slate", {"prm": "programmatic", "k": 3}),
         "k=3 candidates per step does not divide num_generations=4; allowed: num_generations a multiple of k"),
    Case("verl-erank-ema-alpha-zero", "stack", ("verl_erank", {"ema_alpha": 0}),
         "Option 'ema_alpha' of plugin 'verl_erank' got 0.0; allowed: a value > 0.0 and <= 1.0"),
    Case("thr-p-beyond-one", "stack", ("thr", {"p": 2.0}),
         "Option 'p' of plugin 'thr' got 2.0; allowed: a value <= 1.0 and >= -1.0"),
    Case("endpoint-url-no-scheme", "stack", ("ruscarl", {**RUSCARL_ENDPOINT, "judge_base_url": "127.0.0.1:8000/v1"}),
         "Endpoint URL '127.0.0.1:8000/v1' is malformed"),
    Case("endpoint-url-bad-scheme", "stack", ("ruscarl", {**RUSCARL_ENDPOINT, "judge_base_url": "ftp://h/v1"}),
         "the scheme is 'ftp', not 'http' or 'https'"),
    Case("endpoint-url-bad-port", "stack", ("ruscarl", {**RUSCARL_ENDPOINT, "judge_base_url": "http://h:80a0/v1"}),
         "Endpoint URL 'http://h:80a0/v1' is malformed"),
    Case("endpoint-url-no-host", "stack", ("ruscarl", {**RUSCARL_ENDPOINT, "judge_base_url": "http:///v1"}),
         "it has no host"),
    Case("endpoint-url-blank", "stack", ("ruscarl", {**RUSCARL_ENDPOINT, "judge_base_url": " "}), "Endpoint URL"),
    Case("teacher-url-malformed", "stack",
         ("scope", {"prm": "programmatic", "teacher": "endpoint", "teacher_model": "m",
                    "teacher_base_url": "htp://h:8000"}),
         "the scheme is 'htp'"),
    Case("prm-url-malformed", "stack", ("posterior_grpo", {"prm": "endpoint", "prm_model": "m",
                                                           "prm_base_url": "http://h:99999"}),
         "Endpoint URL 'http://h:99999' is malformed"),
    Case("critic-url-malformed", "stack",
         ("critique_grpo", {"critique_type": "text", "critic_model": "m", "critic_base_url": "localhost"}),
         "Endpoint URL 'localhost' is malformed"),
    Case("fbos-judge-url-malformed", "trainer",
         {"plugins": ["fbos_rl"], "reward": "digits",
          "plugin_config": {"fbos_rl": {"feedback": "judge", "judge_model": "m", "judge_base_url": "http//h:8000/v1"}}},
         "Endpoint URL 'http//h:8000/v1' is malformed"),
    # ---------------------------------------------------------------- data
    Case("slate-stop-string-never-matches", "trainer",
         {"plugins": ["slate"], "plugin_config": {"slate": {"prm": "programmatic", "k": 2, "step_stops": ["§"]}}},
         "Stop string '§' of plugin 'slate' can never match: the tokenizer writes it as ''"),
    Case("empty-dataset", "trainer", {"dataset": "empty"}, "The training dataset is empty (0 rows)"),
    Case("no-prompt-column", "trainer", {"dataset": "no_prompt"}, "has no 'prompt' column (columns: question"),
    Case("prompt-not-text", "trainer", {"dataset": "int_prompt"}, "has a 'prompt' of type int"),
    Case("accuracy-answers-none", "trainer", {"dataset": "answers_none"},
         "accuracy_reward: column 'answer' is not an integer in every one of the 8 rows"),
    Case("accuracy-answers-some-blank", "trainer", {"dataset": "answers_some_blank"},
         "warn:column 'answer' is not an integer in 2 of 8 rows (first: row 0"),
    Case("reward-needs-missing-column", "trainer", {"reward": "needs_column"},
         "needs the dataset column 'difficulty'"),
    Case("plugin-needs-missing-column", "trainer", {"dataset": "no_solution", "plugins": ["hint_scaffold"]},
         "Plugin 'hint_scaffold' needs the dataset column 'solution'"),
    Case("critique-answers-all-none", "trainer",
         {"dataset": "answers_none", "plugins": ["critique_grpo"], "reward": "digits",
          "plugin_config": {"critique_grpo": {"critique_type": "simple_gt"}}},
         "critique_grpo: column 'answer' is empty (None or blank) in every one of the 8 rows"),
    Case("critique-answers-some-none", "trainer",
         {"dataset": "answers_some_blank", "plugins": ["critique_grpo"], "reward": "digits",
          "plugin_config": {"critique_grpo": {"critique_type": "simple_gt"}}},
         "warn:critique_grpo: column 'answer' is empty (None or blank) in 2 of 8 rows"),
    Case("rlpr-answers-all-empty", "trainer", {"dataset": "answers_blank", "plugins": ["rlpr"], "reward": "digits"},
         "rlpr: column 'answer' is empty (None or blank) in every one of the 8 rows"),
    Case("rlp-documents-too-short", "trainer",
         {"plugins": ["rlp"], "reward": "digits",
          "plugin_config": {"rlp": {"text_column": "solution", "min_context_words": 40}}},
         "rlp: no document of column 'solution' has the 40 + 1 words one context/continuation row needs (8 documents)"),
    Case("ruscarl-rubrics-as-text", "trainer", {"dataset": "rubrics_text", "plugins": ["ruscarl"], "reward": "digits",
                                                 "plugin_config": {"ruscarl": {"judge": "rule"}}},
         "ruscarl: column 'rubrics' holds str"),
    Case("ruscarl-rubrics-empty", "trainer", {"dataset": "rubrics_empty", "plugins": ["ruscarl"], "reward": "digits",
                                              "plugin_config": {"ruscarl": {"judge": "rule"}}},
         "ruscarl: 8 of 8 rows have no rubric items"),
    Case("unsupported-loss-type", "trainer", {"plugins": ["lp_reg"], "config": {"loss_type": "bogus_loss"}},
         "bogus_loss"),
    # ---------------------------------------------------------------- environment
    Case("autoload-unknown-value", "env", {"TRL_PLUGINS_DISABLE_AUTOLOAD": "maybe"},
         "TRL_PLUGINS_DISABLE_AUTOLOAD='maybe' is not a boolean"),
    Case("autoload-disabled-unknown-plugin", "env", {"TRL_PLUGINS_DISABLE_AUTOLOAD": "1", "plugin": "my_method"},
         "Entry-point plugins are not loaded because TRL_PLUGINS_DISABLE_AUTOLOAD='1'"),
    Case("load-list-unknown-plugin", "env", {"TRL_PLUGINS_LOAD": "other", "plugin": "my_method"},
         "Only the entry-point plugins named in TRL_PLUGINS_LOAD='other' are loaded"),
    # ---------------------------------------------------------------- resume
    Case("state-empty", "resume", b"", "is empty (0 bytes)"),
    Case("state-truncated", "resume", "truncated", "is truncated or corrupt and cannot be read"),
    Case("state-garbage", "resume", b"not a checkpoint at all", "is truncated or corrupt"),
    Case("state-a-list", "resume", [1, 2, 3], "holds list [1, 2, 3], not the dict of plugin states"),
    Case("state-a-tensor", "resume", torch.zeros(2), "holds Tensor"),
    Case("state-int-keys", "resume", {1: {}}, "not the dict of plugin states"),
    Case("state-foreign-plugins", "resume", {"__framework__": {}, "canon": {}, "laser": {"x": 1}},
         "warn:holds state for plugins ['canon'], which this run does not enable"),
    # ---------------------------------------------------------------- security (issue 29)
    Case("state-crafted-pickle-runs-nothing", "resume", {"__framework__": {}, "length_shaping": _Planted()},
         "Refusing to load"),
    Case("state-crafted-pickle-names-the-object", "resume", {"length_shaping": [_Planted()]},
         "it holds a pickled posix.system"),
    Case("state-plain-pickle", "resume", "plain-pickle", "is truncated or corrupt (or not a plugin state file"),
    Case("state-a-class-instance", "resume", {"length_shaping": _Plain()}, "it holds a pickled"),
    Case("endpoint-url-credentials-redacted", "stack",
         ("ruscarl", {**RUSCARL_ENDPOINT, "judge_base_url": "ftp://bob:S3CRET@h/v1?api_key=K3Y"}),
         "Endpoint URL 'ftp://***@h/v1?api_key=***' is malformed"),
    Case("endpoint-url-token-param-redacted", "stack",
         ("ruscarl", {**RUSCARL_ENDPOINT, "judge_base_url": "htp://h/v1?access_token=T0K&x=1"}),
         "'htp://h/v1?access_token=***&x=1'"),
    # ---------------------------------------------------------------- tool guard settings (issue 29)
    Case("tool-timeout-inf", "config", _config(tool_timeout=math.inf),
         "tool_timeout must be a finite number of seconds > 0, or None for no limit; got inf"),
    Case("tool-timeout-nan", "config", _config(tool_timeout=math.nan), "tool_timeout must be a finite number"),
    Case("tool-timeout-string", "config", _config(tool_timeout="60"), "got '60'"),
    Case("tool-backoff-nan", "config", _config(tool_retry_backoff=math.nan),
         "tool_retry_backoff must be a finite number of seconds in [0, 3600]; got nan"),
    Case("tool-backoff-inf", "config", _config(tool_retry_backoff=math.inf), "tool_retry_backoff must be a finite"),
    Case("tool-backoff-huge", "config", _config(tool_retry_backoff=1e12), "got 1000000000000.0"),
    Case("yaml-tool-timeout-inf", "cli", {"tool_timeout": math.inf}, "tool_timeout must be a finite number"),
    # ---------------------------------------------------------------- str.format templates (issue 29)
    Case("igpo-answer-template-without-answer", "config",
         _config(plugins={"igpo": {"answer_template": "The answer"}}),
         "Option 'answer_template' of plugin 'igpo' got 'The answer'; it must contain {answer}"),
    Case("igpo-answer-template-unknown-field", "config", _config(plugins={"igpo": {"answer_template": "{answr}"}}),
         "it has the field {answr}, which the plugin does not fill. Allowed fields: {answer}"),
    Case("igpo-answer-template-positional", "config", _config(plugins={"igpo": {"answer_template": "{} {answer}"}}),
         "a positional field {} is filled by nothing"),
    Case("igpo-answer-template-attribute", "config",
         _config(plugins={"igpo": {"answer_template": "{answer.__class__}"}}),
         "reads an attribute or item of {answer}"),
    Case("igpo-answer-template-unbalanced", "config", _config(plugins={"igpo": {"answer_template": "{answer"}}),
         "it is not a valid template (expected '}' before end of string)"),
    Case("kepo-hint-template-unknown-field", "config",
         _config(plugins={"kepo": {"hints": "none", "lam": 1.0, "hint_template": "{questoin} {hint}"}}),
         "Option 'hint_template' of plugin 'kepo' got '{questoin} {hint}'; it has the field {questoin}"),
    Case("kepo-hint-request-unknown-field", "config",
         _config(plugins={"kepo": {"hints": "none", "lam": 1.0, "hint_request": "{question} in {lang}"}}),
         "Option 'hint_request' of plugin 'kepo' got '{question} in {lang}'; it has the field {lang}"),
    Case("rlpr-answer-template-unknown-field", "config", _config(plugins={"rlpr": {"answer_template": "{answer} {x}"}}),
         "Option 'answer_template' of plugin 'rlpr' got '{answer} {x}'; it has the field {x}"),
    Case("rlp-thought-close-blank", "config", _config(plugins={"rlp": {"thought_close": " "}}),
         "Option 'thought_close' of plugin 'rlp' got ' '; it must be a non-blank string"),
    Case("critique-refinement-template-unknown-field", "config",
         _config(plugins={"critique_grpo": {"refinement_template": "{question}{response}{critique}{solution}"}}),
         "it has the field {solution}, which the plugin does not fill"),
    Case("genrm-k-zero", "config", _config(plugins={"deepseek_grm": {"genrm": "scripted", "k": 0}}),
         "Option 'k' of plugin 'deepseek_grm' got 0; allowed: a value >= 1"),
    Case("genrm-meta-keep-over-k", "config",
         _config(plugins={"deepseek_grm": {"genrm": "scripted", "k": 4, "meta_keep": 6}}),
         "meta_keep=6 is more than k=4"),
    Case("libra-rm-aggregate-vote", "config",
         _config(plugins={"libra_rm": {"genrm": "scripted", "aggregate": "vote"}}),
         "Option 'aggregate' of plugin 'libra_rm' got 'vote'"),
    Case("urpo-empty-score-range", "config", _config(plugins={"urpo": {"score_low": 10.0, "score_high": 1.0}}),
         "Plugin 'urpo': score range [10.0, 1.0] is empty"),
    Case("urpo-judge-format-without-responses", "config",
         _config(plugins={"urpo": {"instruction": "Judge {question}"}}),
         "Option 'instruction' of plugin 'urpo'"),
    Case("urpo-one-verdict", "config", _config(plugins={"urpo": {"verdict_rows": 1}}),
         "Plugin 'urpo': verdict_rows=1; allowed: 0 (untrained self-judgements) or 2 and more"),
    Case("acre-option-format-without-option", "config", _config(plugins={"acre": {"option_format": "{letter})"}}),
         "option_format"),
    Case("acre-scale-above-one", "config", _config(plugins={"acre": {"inconsistent_scale": 1.5}}),
         "Option 'inconsistent_scale' of plugin 'acre' got 1.5"),
    Case("listener-marker-not-a-regex", "config",
         _config(plugins={"listener": {"teacher_model": "unused", "answer_marker": "(Answer"}}),
         "Plugin 'listener': answer_marker='(Answer' is not a valid regex"),
    Case("listener-hf-without-model", "config", _config(plugins={"listener": {}}),
         "Plugin 'listener' with teacher='hf' needs teacher_model"),
    Case("rapo-retention-later-task-without-previous-policy", "config", _config(plugins={"rapo_retention": {}}),
         "Plugin 'rapo_retention' with teacher='hf' needs teacher_model"),
    Case("rapo-retention-state-file-without-ctan", "config",
         _config(plugins={"rapo_retention": {"task_index": 1, "ctan": False, "ctan_state_file": "ctan.json"}}),
         "ctan_state_file='ctan.json' is only used with ctan=True"),

    Case("data-prm-verdict-rewards-out-of-order", "config",
         _config(plugins={"data_prm": {"genrm": "scripted", "correct_reward": 0.0, "wrong_reward": 1.0}}),
         "Options correct_reward / neutral_reward / wrong_reward of plugin 'data_prm' are (0.0, 0.5, 1.0)"),
    Case("genrm-url-malformed", "stack", ("think_rm", {"genrm_base_url": "localhost", "advantage": "trl"}),
         "Endpoint URL 'localhost' is malformed"),
    Case("genrm-oracle-unknown", "config", _config(plugins={"think_rm": {"genrm": "scripted", "genrm_oracle": "chess"}}),
         "Option 'genrm_oracle' of plugin 'think_rm'"),
    Case("think-rm-pairwise-with-weighted-columns", "trainer",
         {"plugins": ["think_rm"], "reward": "digits", "plugin_config": {"think_rm": {"genrm": "scripted"}}},
         "think_rm with advantage='pairwise' replaces TRL's advantages"),
    Case("dno-beta-zero", "config", _config(plugins={"dno": {"beta": 0.0}}),
         "Option 'beta' of plugin 'dno' got 0.0; allowed: a value > 0.0"),
    Case("dno-endpoint-without-url", "stack", ("dno", {"genrm": "endpoint"}),
         "Plugin 'dno' with genrm='endpoint' needs genrm_base_url"),
    Case("dno-batch-not-whole-groups", "trainer",
         {"plugins": ["dno"], "reward": "digits",
          "config": {"per_device_train_batch_size": 2, "gradient_accumulation_steps": 2}},
         "per_device_train_batch_size=2 is not a multiple of num_generations"),
    Case("yaml-igpo-template-without-answer", "cli", {"plugins": {"igpo": {"answer_template": "Answer:"}}},
         "it must contain {answer}"),
    # ---------------------------------------------------------------- data cells (issue 29)
    Case("e-grpo-entities-as-text", "trainer", {"dataset": "entities_text", "plugins": ["e_grpo"], "reward": "digits"},
         "e_grpo: column 'entities' holds str 'Paris' in row 0; allowed: a list of strings"),
    Case("e-grpo-entities-numbers", "trainer", {"dataset": "entities_ints", "plugins": ["e_grpo"], "reward": "digits"},
         "e_grpo: column 'entities' holds list [1, 2] in row 0"),
    Case("funrl-gold-calls-bad-json", "trainer", {"dataset": "gold_bad_json", "plugins": ["funrl"], "reward": "digits"},
         "funrl: column 'gold_calls' holds str '[{\"name\": \"search\"' in row 0; allowed: a JSON list"),
    Case("funrl-gold-calls-not-calls", "trainer", {"dataset": "gold_numbers", "plugins": ["funrl"], "reward": "digits"},
         "funrl: column 'gold_calls' holds list [1, 2] in row 0"),
    Case("matchtir-gold-calls-bad-json", "trainer",
         {"dataset": "gold_bad_json", "plugins": ["matchtir"], "reward": "digits"},
         "matchtir: column 'gold_calls' holds str"),
    Case("ampo-solutions-a-number", "trainer",
         {"dataset": "solutions_number", "plugins": ["ampo"], "reward": "digits",
          "plugin_config": {"ampo": {"teachers": "column"}}},
         "ampo: column 'teacher_solutions' holds int 7 in row 0; allowed: a list of solutions"),
    Case("light-if-constraints-as-text", "trainer",
         {"dataset": "constraints_text", "plugins": ["light_if"], "reward": "digits"},
         "light_if: column 'constraints' holds str 'at most 50 words' in row 0; allowed: a list of constraint dicts"),
    Case("light-if-unknown-constraint-type", "config",
         _config(plugins=["light_if"], plugin_config={"light_if": {"constraints": [{"type": "rhyme"}]}}),
         "constraint type 'rhyme' is not one of"),
    Case("ic-grpo-template-without-question", "config",
         _config(plugins=["ic_grpo"], plugin_config={"ic_grpo": {"templates": ["Answer it"]}}),
         "Option 'templates' of plugin 'ic_grpo' got 'Answer it'; allowed: strings holding '{question}'"),
    Case("ic-grpo-paraphrases-as-text", "trainer",
         {"dataset": "paraphrases_text", "plugins": ["ic_grpo"], "reward": "digits"},
         "ic_grpo: column 'paraphrases' holds str 'What is it?' in row 0"),
    # ---------------------------------------------------------------- the command line: argparse's own errors
    Case("yaml-wrong-typed-field", "cli", {"per_device_train_batch_size": "eight"},
         "Invalid configuration: argument --per_device_train_batch_size"),
    Case("cli-wrong-typed-flag", "cli", ({}, ["--max_steps", "two"]), "invalid int value: 'two'"),
    # ---------------------------------------------------------------- trl-plugins compare (issue 29)
    Case("compare-seeds-zero", "compare", ({}, ["--seeds", "0"]), "--seeds must be an integer >= 1"),
    Case("compare-seeds-negative", "compare", ({}, ["--seeds", "-2"]), "--seeds must be an integer >= 1"),
    Case("compare-rollouts-zero", "compare", ({}, ["--rollouts", "0"]), "--rollouts must be an integer >= 1"),
    Case("compare-rollouts-negative", "compare", ({}, ["--rollouts", "-8"]), "got -8"),
    Case("compare-eval-every-zero", "compare", ({}, ["--eval-every", "0"]), "--eval-every must be an integer >= 1"),
    Case("compare-eval-size-zero", "compare", ({}, ["--eval-size", "0"]), "--eval-size must be an integer >= 1"),
    Case("compare-target-nan", "compare", ({}, ["--target", "nan"]), "--target must be a finite number; got nan"),
    Case("compare-config-missing", "compare", ("{missing}", []), "Could not read the config file"),
    Case("compare-bad-yaml", "compare", ("plugins: [lp_reg\nmax_steps: 1\n", []), "Could not read the config file"),
    Case("compare-not-a-mapping", "compare", ("[1, 2, 3]", []), "must hold a YAML mapping of fields"),
    Case("compare-wrong-typed-field", "compare", ({"per_device_train_batch_size": "eight"}, []),
         "Invalid configuration: argument --per_device_train_batch_size"),
    Case("compare-unknown-field", "compare", ({"max_step": 3}, []), "Unknown field 'max_step'"),
    Case("compare-plugins-not-a-list", "compare", ({"plugins": 5}, []), "must be a list of plugin names; got 5"),
    Case("compare-environment-factory-missing", "compare", ({"environment_factory": "my_env.Env"}, []),
         "Could not import environment_factory 'my_env.Env': No module named 'my_env'"),
    Case("compare-tools-missing", "compare", ({"tools": ["my_tools.search"]}, []),
         "Could not import Tool 'my_tools.search'"),
    Case("compare-environment-without-reset", "compare",
         ({"environment_factory": "trl_plugins.tasks.arithmetic.Problem"}, []), "class Problem has no reset() method"),
    Case("compare-reward-unknown", "compare", ({"reward_funcs": ["acuracy"]}, []), "acuracy"),
    Case("compare-misspelt-stack", "compare", ({}, ["--stacks", "grpo", "lp_rge"]), "Did you mean 'lp_reg'"),
    Case("environment-without-tool-methods", "trainer", {"environment_factory": _NoToolEnvironment},
         "environment_factory ['_NoToolEnvironment']: its environments have no tool method"),
    # ---------------------------------------------------------------- values that only exist at run time: the first row
    Case("reward-nan-in-a-row", "row", {"value": math.nan}, "Reward function 'judge' returned nan for row 1"),
    Case("reward-inf-in-a-row", "row", {"value": math.inf}, "Reward function 'judge' returned inf for row 1"),
    Case("reward-minus-inf-in-a-row", "row", {"value": -math.inf}, "returned -inf for row 1"),
    Case("reward-numeric-string-in-a-row", "row", {"value": "0.5"}, "returned '0.5' (str), which is not a number"),
    Case("reward-text-in-a-row", "row", {"value": "good"}, "returned 'good' (str), which is not a number"),
    Case("reward-list-in-a-row", "row", {"value": [1.0]}, "returned [1.0] (list), which is not a number"),
    Case("reward-too-few", "row", {"returns": "short"}, "Reward function 'judge' returned 3 rewards for 4 completions"),
    Case("reward-none-list", "row", {"returns": "none"}, "Reward function 'judge' returned None instead of a list"),
    Case("reward-all-none", "row", {"returns": "all_none"}, "warn:returned None for every one of the 4 completions"),
]


def _float_options():
    for name, cls in available_plugins().items():
        if cls.__module__.split(".")[0] != "trl_plugins_builtin":
            continue
        hints = typing.get_type_hints(cls.Options)
        for f in dataclasses.fields(cls.Options):
            tp = hints[f.name]
            if tp is float or tp == (float | None):
                if not f.metadata.get("allow_nonfinite"):
                    yield name, f.name


GENERATED = [
    Case(f"nan-{plugin}-{option}", "config", _config(plugins=[plugin], plugin_config={plugin: {option: math.nan}}),
         f"Option {option!r} of plugin {plugin!r} got nan; allowed: a finite number")
    for plugin, option in _float_options()
] + [
    Case(f"misspelt-option-{plugin}", "config", _config(plugins=[plugin], plugin_config={plugin: {"bogus_opt": 1}}),
         f"Unknown option 'bogus_opt' for plugin {plugin!r}")
    for plugin in sorted(available_plugins()) if available_plugins()[plugin].__module__.startswith("trl_plugins_builtin")
]


# ============================================================================================ runners
def _expect(message, action):
    """Run ``action``; it must raise a PluginError containing ``message``, or, for ``warn:``, warn with it."""
    if message.startswith("warn:"):
        with pytest.warns(UserWarning) as caught:
            action()
        texts = [str(w.message) for w in caught]
        assert any(message[5:] in t for t in texts), texts
        return
    with pytest.raises(PluginError) as err:
        action()
    assert message in str(err.value), str(err.value)


def _fill(value, tmp_path):
    if isinstance(value, str):
        if value in ("{file}", "{file}/out"):
            path = tmp_path / "a_file"
            path.write_text("x")
            return str(path) + value[len("{file}"):]
        if value == "{json}":
            (tmp_path / "data").mkdir(exist_ok=True)
            (tmp_path / "data" / "train.jsonl").write_text('{"prompt": "1+1", "answer": 2}\n')
            return str(tmp_path / "data")
        if value == "{missing}":
            return str(tmp_path / "no_such_dataset")
    return value


def run_config(case, tmp_path):
    fields = {k: _fill(v, tmp_path) for k, v in case.input.items()}
    fields.setdefault("output_dir", str(tmp_path / "out"))
    _expect(case.message, lambda: PluginGRPOConfig(report_to="none", use_cpu=True, **fields))


def run_cli(case, tmp_path, capsys, monkeypatch):
    import trl_plugins.cli.train as train_module

    def never(*args, **kwargs):
        raise AssertionError("the model was loaded: the config was not refused first")

    monkeypatch.setattr(train_module, "load_model", never)
    config, overrides = case.input if isinstance(case.input, tuple) else (case.input, [])
    path = tmp_path / "config.yaml"
    if isinstance(config, str):
        path.write_text(config)
    else:
        config = {k: _fill(v, tmp_path) for k, v in config.items()}
        path.write_text(yaml.safe_dump({**BASE_YAML, "output_dir": str(tmp_path / "out"), **config}))
    monkeypatch.chdir(tmp_path)
    status = main(["train", str(path), *overrides])
    err = capsys.readouterr().err
    assert status == 2, err
    last = err.strip().splitlines()[-1]  # (after any progress output of datasets)
    assert last.startswith("trl-plugins: error: "), err
    assert case.message in last, err


def run_stack(case, tmp_path):
    plugin, options = case.input
    _expect(case.message, lambda: build_stack(plugin, {plugin: options}, output_dir=str(tmp_path),
                                              scale_rewards="none"))


def _dataset(kind):
    base = tiny_dataset(8).to_list()
    if kind == "empty":
        return Dataset.from_list(base).select([])
    if kind == "no_prompt":
        return Dataset.from_list([{("question" if k == "prompt" else k): v for k, v in r.items()} for r in base])
    if kind == "int_prompt":
        return Dataset.from_list([{**r, "prompt": i} for i, r in enumerate(base)])
    if kind == "answers_none":
        return Dataset.from_list([{**r, "answer": None} for r in base])
    if kind == "answers_blank":
        return Dataset.from_list([{**r, "answer": " "} for r in base])
    if kind == "answers_some_blank":
        return Dataset.from_list([{**r, "answer": "" if i in (0, 5) else str(r["answer"])} for i, r in enumerate(base)])
    if kind == "no_solution":
        return Dataset.from_list([{k: v for k, v in r.items() if k != "solution"} for r in base])
    if kind == "rubrics_text":
        return Dataset.from_list([{**r, "rubrics": "mentions the answer"} for r in base])
    if kind == "rubrics_empty":
        return Dataset.from_list([{**r, "rubrics": []} for r in base])
    if kind == "gold_bad_json":
        return Dataset.from_list([{**r, "gold_calls": '[{"name": "search"'} for r in base])
    if kind == "gold_numbers":
        return Dataset.from_list([{**r, "gold_calls": [1, 2]} for r in base])
    if kind == "solutions_number":
        return Dataset.from_list([{**r, "teacher_solutions": 7} for r in base])
    if kind == "entities_text":
        return Dataset.from_list([{**r, "entities": "Paris"} for r in base])
    if kind == "constraints_text":
        return Dataset.from_list([{**r, "constraints": "at most 50 words"} for r in base])
    if kind == "paraphrases_text":
        return Dataset.from_list([{**r, "paraphrases": "What is it?"} for r in base])
    if kind == "entities_ints":
        return Dataset.from_list([{**r, "entities": [1, 2]} for r in base])
    return Dataset.from_list(base)


def _needs_difficulty(completions, difficulty, **kwargs):
    return [0.0] * len(completions)


def run_trainer(case, tmp_path):
    spec = case.input
    rewards = {"digits": [digit_fraction_reward], "needs_column": [_needs_difficulty]}.get(spec.get("reward"))

    agent = {}
    if spec.get("environment_factory"):
        from trl_plugins.tasks.tools import enable_tool_calling
        from trl_plugins.testing import tiny_tokenizer

        agent = {"environment_factory": spec["environment_factory"], "tokenizer": enable_tool_calling(tiny_tokenizer())}

    def build():
        make_tiny_trainer(dataset=_dataset(spec.get("dataset")), reward_funcs=rewards, output_dir=str(tmp_path),
                          plugins=spec.get("plugins", []), plugin_config=spec.get("plugin_config"),
                          log_level="error", **agent, **spec.get("config", {}))

    _expect(case.message, build)


def run_env(case, monkeypatch):
    env = dict(case.input)
    plugin = env.pop("plugin", None)
    monkeypatch.delenv("TRL_PLUGINS_DISABLE_AUTOLOAD", raising=False)
    monkeypatch.delenv("TRL_PLUGINS_LOAD", raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    from trl_plugins.runtime.manager import build_plugins

    _expect(case.message, lambda: build_plugins([plugin] if plugin else ["canon"]))


@pytest.fixture(scope="module")
def resume_trainer(tmp_path_factory):
    return make_tiny_trainer(plugins=["laser"], reward_funcs=[digit_fraction_reward], log_level="error",
                             output_dir=str(tmp_path_factory.mktemp("resume")))


def run_resume(case, tmp_path, trainer):
    import io

    path = tmp_path / PLUGIN_STATE_FILE
    if isinstance(case.input, bytes):
        path.write_bytes(case.input)
    elif case.input == "plain-pickle":
        import pickle

        path.write_bytes(pickle.dumps({"length_shaping": _Planted()}))  # not torch's zip format
    elif case.input == "truncated":
        buffer = io.BytesIO()
        torch.save({"__framework__": {}, "laser": {"history": list(range(500))}}, buffer)
        path.write_bytes(buffer.getvalue()[: len(buffer.getvalue()) // 2])
    else:
        torch.save(case.input, path)
    _expect(case.message, lambda: trainer._load_optimizer_and_scheduler(str(tmp_path)))
    if not case.message.startswith("warn:"):
        with pytest.raises(PluginError, match=str(path).replace("\\", "\\\\")):  # the message names the file
            trainer._load_optimizer_and_scheduler(str(tmp_path))


def run_compare(case, tmp_path, capsys, monkeypatch):
    import trl_plugins.cli.compare as compare

    monkeypatch.setattr(compare, "run_one", lambda *a, **k: pytest.fail("a run started: the input was not refused"))
    config, flags = case.input
    path = tmp_path / "config.yaml"
    if config == "{missing}":
        path = tmp_path / "no_such_config.yaml"
    elif isinstance(config, str):
        path.write_text(config)
    else:
        path.write_text(yaml.safe_dump({**BASE_YAML, "output_dir": str(tmp_path / "out"), **config}))
    monkeypatch.chdir(tmp_path)
    status = main(["compare", str(path), *flags, "--output-dir", str(tmp_path / "cmp")])
    err = capsys.readouterr().err
    assert status == 2, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("trl-plugins: error: "), err
    assert case.message in last, err


def _row_reward(spec):
    def judge(completions, **kwargs):
        returns = spec.get("returns")
        if returns == "short":
            return [0.5] * (len(completions) - 1)
        if returns == "none":
            return None
        if returns == "all_none":
            return [None] * len(completions)
        return [spec["value"] if i == 1 else 0.5 for i in range(len(completions))]

    return judge


def run_row(case, tmp_path):
    trainer = make_tiny_trainer(reward_funcs=[digit_fraction_reward, _row_reward(case.input)], output_dir=str(tmp_path),
                                log_level="error")
    rows = [dict(r) for r in tiny_dataset(4)]
    completions = [[{"role": "assistant", "content": "Answer: 1"}]] * 4
    _expect(case.message, lambda: trainer._calculate_rewards(rows, [r["prompt"] for r in rows], completions,
                                                             [[1, 2]] * 4))


ALL = CASES + GENERATED

# ============================================================================================ the docs table
#: The class of a case in docs/reliability.md: when (and by what) its input is refused.
CLASSES = {
    "config": "refused when the config is built",
    "cli": "refused by `trl-plugins train` before the model loads",
    "stack": "refused when the plugins are built",
    "trainer": "refused when the trainer is built",
    "env": "refused at plugin discovery",
    "resume": "refused when the checkpoint is loaded",
    "compare": "refused by `trl-plugins compare` before any run",
    "row": "refused at the first row that carries it",
}


def case_class(case: Case) -> str:
    """The class of ``case`` (a ``warn:`` case is warned about, not refused)."""
    text = CLASSES[case.stage]
    return text.replace("refused", "warned", 1) if case.message.startswith("warn:") else text


def _shown(value: Any, limit: int = 90) -> str:
    if isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], list):  # (config, command-line flags)
        config = _shown(value[0], limit) if value[0] not in ({}, "") else ""
        return _shown(" ".join(x for x in (config, " ".join(map(str, value[1]))) if x), limit)
    if isinstance(value, dict):
        text = ", ".join(f"{k}: {_shown(v, limit)}" for k, v in value.items())
    elif isinstance(value, (bytes, bytearray)):
        text = f"{len(value)} bytes {bytes(value[:12])!r}"
    elif isinstance(value, (list, tuple)):
        inner = ", ".join(_shown(v, limit) for v in value)
        text = f"[{inner}]" if isinstance(value, list) else f"({inner})"
    elif isinstance(value, str):
        text = value.replace("\n", "\\n")
    elif value is None or isinstance(value, (bool, int, float)):
        text = repr(value)
    elif isinstance(value, type) or callable(value):
        text = f"class {value.__name__}" if isinstance(value, type) else f"function {value.__name__}"
    else:  # an object: its class (a repr would hold a memory address)
        text = f"a {type(value).__name__} instance"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def markdown_table() -> str:
    """docs/reliability.md's generated section: a count per class, one row per hand-written case, and one row per
    group of schema-generated cases."""
    lines = [f"{len(ALL)} cases in `tests/reliability/test_bad_inputs.py` ({len(CASES)} written by hand, "
             f"{len(GENERATED)} generated from the built-in plugins' option schemas); every one is a test.", "",
             "| class | cases |", "| --- | --- |"]
    counts: dict[str, int] = {}
    for case in ALL:
        counts[case_class(case)] = counts.get(case_class(case), 0) + 1
    lines += [f"| {name} | {n} |" for name, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))]
    lines += ["", "| case | class | input | the message contains |", "| --- | --- | --- | --- |"]
    for case in CASES:
        message = case.message[5:] if case.message.startswith("warn:") else case.message
        lines.append(f"| `{case.id}` | {case_class(case)} | `{_cell(_shown(case.input))}` | {_cell(message)} |")
    nan = [c for c in GENERATED if c.id.startswith("nan-")]
    misspelt = [c for c in GENERATED if c.id.startswith("misspelt-option-")]
    lines.append(f"| `nan-<plugin>-<option>` ({len(nan)} cases) | {CLASSES['config']} | NaN for every float option of "
                 "every built-in plugin (options marked allow_nonfinite excepted) | "
                 "Option '<option>' of plugin '<plugin>' got nan; allowed: a finite number |")
    lines.append(f"| `misspelt-option-<plugin>` ({len(misspelt)} cases) | {CLASSES['config']} | `bogus_opt: 1` for "
                 "every built-in plugin | Unknown option 'bogus_opt' for plugin '<plugin>' |")
    assert len(nan) + len(misspelt) == len(GENERATED), "a generated group the table does not show"
    return "\n".join(lines) + "\n"


def test_the_table_is_large_and_its_ids_distinct():
    assert len({c.id for c in ALL}) == len(ALL)
    assert len(ALL) >= 120, len(ALL)
    assert {c.stage for c in ALL} == set(CLASSES)
    assert len(GENERATED) > len(list(builtin_modules()))  # every plugin contributes at least one case


@pytest.mark.parametrize("case", ALL, ids=[c.id for c in ALL])
def test_bad_input(case, tmp_path, capsys, monkeypatch, request):
    if case.stage == "config":
        run_config(case, tmp_path)
    elif case.stage == "cli":
        run_cli(case, tmp_path, capsys, monkeypatch)
    elif case.stage == "stack":
        run_stack(case, tmp_path)
    elif case.stage == "trainer":
        run_trainer(case, tmp_path)
    elif case.stage == "env":
        run_env(case, monkeypatch)
    elif case.stage == "resume":
        run_resume(case, tmp_path, request.getfixturevalue("resume_trainer"))
    elif case.stage == "compare":
        run_compare(case, tmp_path, capsys, monkeypatch)
    elif case.stage == "row":
        run_row(case, tmp_path)
    else:  # pragma: no cover
        raise AssertionError(case.stage)

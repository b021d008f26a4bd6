"""DeepSearch — Monte-Carlo tree search inside RLVR training (arXiv:2509.25454).

Each prompt's G rollouts are the terminal paths of a search tree grown during the rollout, instead of G independent
samples; each path's tokens are credited step by step with the values the tree backs up. Facts from the official
code (smiles724/DeepSearch @ daf9067, ``deepsearch/utils/mcts.py`` (``MCTS``), ``deepsearch/rollout/
sglang_mcts_wrapper.py`` (``WRAP``), ``deepsearch/reward_manager/advantage_fn.py`` (``ADV``),
``deepsearch/register_replay_buffer.py`` (``BUF``), ``round0.sh`` / ``round1.sh``):

* **Steps** (WRAP:79, 94-96): a node is one step of ``max_completion_length // max_depth`` tokens sampled after its
  parent's path (``max_depth`` 64 in the scripts, 32 in the code); a child is terminal when it ends with EOS or
  reaches ``max_depth`` (MCTS:429-430, WRAP:514-519).
* **Expansion** (MCTS:149-171): the current node gets ``expansion_width`` children (8 in the scripts, G in the
  code) in one generation call; every tree of the batch expands its current node in the same call (WRAP:360-365).
* **Terminal choice, entropy-guided** (MCTS:195-302): among the new terminal children the correct ones are kept
  (else the incorrect, else the incomplete ones) and only the one with the lowest trajectory entropy
  ``-mean log p`` of its sampled tokens (the most confident, MCTS:236-239, 294-299) is backed up and recorded as a
  row of the group; the search ends when G rows are recorded (``terminate_num = n``, WRAP:43).
* **Value backup** (MCTS:42-63, 435-442): a terminal with outcome ``v`` (+1 correct, -1 wrong,
  ``incomplete_score`` -1 for an unfinished path at the depth limit, MCTS:216-221) updates itself and every
  ancestor up to the root (depth ``d``) with weight ``max((d + 1) / (D + 1), backup_threshold)``
  (``backup_threshold`` 0.1); same signs add, a positive outcome overrides a negative value, a negative one leaves a
  positive value; intermediate new children are only visited.
* **Local selection** (MCTS:65-74, 376-411): without a new terminal, the search descends to the child of highest
  ``Q + lambda_puct sqrt(ln N_parent / N)`` (``lambda_puct`` 2; argmax, ``deterministic_sample``); a node whose
  children are all terminal hands over to global selection.
* **Global frontier selection** (MCTS:356-374, 512-564; ``backtrace_method="global"``): after a terminal, the next
  node is the non-terminal, non-root node with fewer than ``expansion_width`` children of highest
  ``l1 tanh(Q_parent) + l4 tanh(Q) + l2 H_node + l3 sqrt(depth / max_depth)`` (defaults 0.4, 0.0, 0.4 with the
  uncertainty term off, 0.01; depth bonus ``sqrt``, or ``log`` / ``constant``), across the whole tree.
* **Step credit** (WRAP:549-577): a row's tokens of step ``k`` get the value of its path node ``k`` (root
  excluded) after the search, ``tanh(value / adv_temperature) q_value_max`` for all but the leaf, whose value is the
  outcome; the advantage (ADV:28-70, ``sibling_mean_std``) subtracts the group's mean of the rows' final scores and,
  with ``norm_adv_by_std_in_grpo``, divides by their std (the scripts turn that off, the default here).
* **Replay buffer** (WRAP:139-256, BUF:47-74): prompts whose fraction of correct rollouts lies in
  ``(0, buffer_threshold]`` (0.25) are registered with their correct solutions; a registered prompt skips the
  search: its G rows are sampled whole and the first rows are replaced by the cached solutions.

Mapping onto TRL (a deliberate approximation of a custom rollout worker, through the branching seam). Every row of a
group but row 0 is deferred (``PromptContext.defer``); TRL's own sample of row 0 cut after its first step is the
root's first child (sampling is autoregressive, so a sample cut after ``S`` tokens has the law of one step). The
after-generation hook runs the search of each group on the process holding the group's row 0; every iteration is
one collective ``ctx.continue_prefixes`` call on every process (zero requests where a process has none; the loop
ends when no process asks for more, decided from one gather), each request one node, counted in the rollout budget
(``plugin_generation_budget``). Terminal paths are judged by TRL's verifier column (``ctx.success``). The groups'
rows, their step lengths and credit values are all-gathered at the end, so a group may straddle processes and the
replay buffer is identical on every process. The advantage stage puts the step credit on the tokens:
``A = (1 - weight) A_TRL + weight A_DeepSearch``.

Reconstructed (the official loop has no node budget and relies on finishing):

* ``node_budget`` caps the nodes generated per tree and step; when it runs out, or the tree has no frontier left,
  before G rows are recorded, the rows left are filled first by the tree's unrecorded terminal paths (in the
  official order of preference: correct, wrong, incomplete, then the most confident), then by completing the best
  frontier nodes by the global score to the end (one more collective call); those paths are not backed up;
* the replay buffer is built online from the tree rows of this run (officially offline between training rounds
  from the saved rollouts), kept in memory (not checkpointed); cached groups keep TRL's outcome advantage;
* ``step_delimiter`` (ours, off by default): a step also ends at this string, so steps follow the text;
* the verdict is TRL's verifier column (officially the boxed-answer checker, with ``incomplete_score`` for an
  unparsable answer: here any path cut at the depth limit that is not correct);
* not ported: the ``uct`` backtrace, stochastic PUCT sampling, the dynamic width schedule and the overlong buffer
  penalty (all off in the scripts but the overlong penalty: use a length-penalty plugin with TRL's rewards), and the
  hard-prompt data filtering between rounds (dataset preparation).

Neutral setting: ``weight=0`` defers nothing and keeps TRL's advantages (vanilla GRPO).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from typing import Literal

import torch

from trl_plugins.api import AdvantageContext, IncompatiblePluginsError, OfficialSource, Plugin, PluginConfigError
from trl_plugins.api import PluginOptions, PromptContext, RolloutContext, hookimpl, option
from trl_plugins.api.collectives import context_device, gather_floats
from trl_plugins.api.reasons import IMAGES_GENERATION_SERVICE, VLLM_BRANCHING, samples_outside_hf_generate

#: Annotation keys of a tree row: token count and credit value of each step of its path; cached-solution rows.
LENGTHS_KEY = "deepsearch_step_lengths"
VALUES_KEY = "deepsearch_step_values"
CACHED_KEY = "deepsearch_cached"


def _refuse(name: str, value, allowed: str) -> None:
    raise PluginConfigError(f"Option '{name}' of plugin 'deepsearch' got {value!r}; allowed: {allowed}.")


@dataclass
class DeepsearchOptions(PluginOptions):
    weight: float = option(
        1.0, min=0.0, max=1.0,
        help="A = (1 - weight) A_TRL + weight A_DeepSearch per token (ours); 1: DeepSearch as published, 0: vanilla "
        "TRL (no tree).",
    )
    expansion_width: int = option(8, min=1, help="Children generated per expansion (official scripts: 8).")
    max_depth: int = option(
        64, min=1, help="Steps per path; a step is max_completion_length // max_depth tokens (official scripts: 64).",
    )
    lambda_puct: float = option(2.0, min=0.0, help="UCT constant of the local child selection (official: 2).")
    backup_threshold: float = option(
        0.1, min=0.0, max=1.0, help="Floor of the backup weight max((d + 1) / (D + 1), threshold) (official: 0.1).",
    )
    global_lambda1: float = option(0.4, help="Global score weight of tanh(Q_parent) (official: 0.4).")
    global_lambda2: float = option(0.4, help="Global score weight of the node's step entropy (official: 0.4).")
    global_lambda3: float = option(0.01, help="Global score weight of the depth bonus (official: 0.01).")
    global_lambda4: float = option(0.0, help="Global score weight of tanh(Q_node) (official: 0.0).")
    depth_bonus: Literal["sqrt", "log", "constant"] = option(
        "sqrt", help="Depth bonus: sqrt(depth / max_depth), log(depth + 1) or depth (official: 'sqrt').",
    )
    uncertainty_bonus: bool = option(
        False, help="Add global_lambda2 x the node's step entropy to the global score (official: off).",
    )
    incomplete_score: float = option(-1.0, help="Outcome of a path cut at the depth limit (official: -1).")
    adv_temperature: float = option(
        1.0, min=0.0, help="Credit of a non-leaf step: tanh(value / T) q_value_max (official: 1); 0: raw values.",
    )
    q_value_max: float = option(1.0, min=0.0, help="Scale of the tanh credit (official: 1).")
    std_normalize: bool = option(
        False, help="Divide the credit by the group's std of final scores (code default True; the scripts: False).",
    )
    node_budget: int = option(
        512, min=1, reconstructed=True,
        help="Nodes (one seam request each) generated per tree and step; >= num_generations (the official loop has no "
        "cap). Unfilled rows then come from the tree.",
    )
    replay_buffer: bool = option(
        True, help="Cache the correct solutions of prompts solved in (0, buffer_threshold] of their rows; a cached "
        "prompt skips the search (official round-1 buffer, built online here).",
    )
    buffer_threshold: float = option(
        0.25, min=0.0, max=1.0, min_exclusive=True, help="Largest correct fraction that registers a prompt (official "
        "buffer_register_threshold: 0.25).",
    )
    step_delimiter: str | None = option(
        None, reconstructed=True, help="A step also ends just after this string (ours); None: fixed-length steps as "
        "official.",
    )

    def validate(self) -> None:
        if self.step_delimiter is not None and not self.step_delimiter.strip(" "):
            _refuse("step_delimiter", self.step_delimiter, "None or a non-empty string that is not only spaces")

    @property
    def enabled(self) -> bool:
        return self.weight > 0


# ============================================================================================ pure tree logic
@dataclass
class Node:
    """One step of the tree: its tokens (the root has none), sampling log-probs, links and statistics."""

    parent: int
    depth: int
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    children: list[int] = field(default_factory=list)
    terminal: bool = False
    eos: bool = False
    final_backup: bool = False
    visits: int = 0
    value: float = 0.0
    score: float | None = None  # outcome of a terminal node once judged
    entropy: float | None = None  # -mean log p over the whole path of a judged terminal node

    def q(self) -> float:
        return self.value / self.visits if self.visits else 0.0

    def step_entropy(self) -> float:
        return neg_mean(self.logprobs)


def neg_mean(logprobs: list[float]) -> float:
    """``-mean log p`` over the finite log-probs (the official stand-in for token entropy); 0 when none."""
    vals = [x for x in logprobs if math.isfinite(x)]
    return -sum(vals) / len(vals) if vals else 0.0


def backup_weight(depth: int, traj_len: int, threshold: float) -> float:
    """Weight of a terminal's outcome at an ancestor of depth ``depth``: ``max((depth + 1) / traj_len, threshold)``."""
    return max((depth + 1) / traj_len, threshold)


def update_value(value: float, outcome: float, weight: float) -> float:
    """The official sign rule: same signs add ``weight * outcome``; a positive outcome replaces a negative value by
    ``weight * outcome``; a negative outcome leaves a positive value."""
    if outcome == 0:
        return value
    if value * outcome >= 0:
        return value + weight * outcome
    return weight * outcome if outcome > 0 else value


def puct(q: float, visits: int, parent_visits: int, c: float) -> float:
    """``Q + c sqrt(ln N_parent / N)``; the bonus is 0 while either count is 0."""
    if visits == 0 or parent_visits == 0:
        return q
    return q + c * math.sqrt(math.log(parent_visits) / visits)


def global_score(q_parent: float, q_node: float, entropy: float, depth: int, o: DeepsearchOptions) -> float:
    """Frontier priority of a node (official ``select_global_best_node``)."""
    s = o.global_lambda1 * math.tanh(q_parent)
    if o.global_lambda4 > 0:
        s += o.global_lambda4 * math.tanh(q_node)
    if o.uncertainty_bonus:
        s += o.global_lambda2 * entropy
    if o.depth_bonus == "constant":
        s += o.global_lambda3 * depth
    elif o.depth_bonus == "log":
        s += o.global_lambda3 * math.log(depth + 1)
    else:
        s += o.global_lambda3 * math.sqrt(depth / o.max_depth)
    return s


def terminal_rank(score: float, entropy: float) -> tuple[int, float]:
    """Sort key of the official terminal choice: correct (+1) first, then wrong (-1), then the rest; then confident."""
    return (0 if score == 1 else 1 if score == -1 else 2, entropy)


def step_credit(values: list[float], o: DeepsearchOptions) -> list[float]:
    """Per-step credit of a path from its nodes' values (root excluded): ``tanh(v / T) q_max`` but the leaf's."""
    if o.adv_temperature <= 0:
        return list(values)
    return [math.tanh(v / o.adv_temperature) * o.q_value_max for v in values[:-1]] + list(values[-1:])


def credit_advantages(lengths: list[list[int]], values: list[list[float]], groups: list[int], width: int,
                      std_normalize: bool, eps: float = 1e-6) -> torch.Tensor:
    """(N, width) per-token DeepSearch advantages (official ``sibling_mean_std``).

    Row ``n``'s step ``k`` covers ``lengths[n][k]`` tokens and carries ``values[n][k]``; its final score is its last
    step's value. Each token gets ``value - mean`` (``/ (std + eps)`` when ``std_normalize``) with the mean and
    (biased) std of the final scores of the rows sharing its group id; a group of one row keeps its values.
    """
    finals = torch.tensor([v[-1] if v else 0.0 for v in values], dtype=torch.float64)
    out = torch.zeros(len(lengths), width, dtype=torch.float64)
    ids = torch.tensor(groups)
    for n, (ls, vs) in enumerate(zip(lengths, values)):
        same = finals[ids == groups[n]]
        mean, std = (same.mean(), same.std(unbiased=False)) if same.numel() > 1 else (0.0, 1.0)
        start = 0
        for length, v in zip(ls, vs):
            a = (v - mean) / (std + eps) if std_normalize else v - mean
            out[n, start:min(start + length, width)] = a
            start += length
    return out.float()


class SearchTree:
    """One prompt's search tree (official ``MCTSAgent``), without generation: the plugin feeds it expansions.

    Usage: :meth:`pending` gives the node to expand and how many children to ask for (backing up and selecting as
    the official ``get_prompts_to_be_expanded`` does when the node is already full); :meth:`expand` adds them; the
    caller judges the new terminal nodes (:meth:`unjudged`, :meth:`judge`) and calls :meth:`backup_and_select`.
    """

    def __init__(self, o: DeepsearchOptions, rows: int, budget: int, limit: int | None = None):
        self.o, self.rows, self.budget, self.limit = o, rows, budget, limit
        self.nodes = [Node(parent=-1, depth=0)]
        self.current = 0
        self.candidates: list[int] = []
        self.recorded: list[int] = []
        self.generated = 0
        self.stopped = False  # budget spent or no frontier left

    # ------------------------------------------------------------------------------------ structure
    def path(self, n: int) -> list[int]:
        """Node ids from the root's first child to ``n``."""
        out = []
        while n > 0:
            out.append(n)
            n = self.nodes[n].parent
        return out[::-1]

    def path_ids(self, n: int) -> list[int]:
        return [t for k in self.path(n) for t in self.nodes[k].ids]

    def path_logprobs(self, n: int) -> list[float]:
        return [x for k in self.path(n) for x in self.nodes[k].logprobs]

    @property
    def done(self) -> bool:
        return len(self.recorded) >= self.rows or self.stopped

    def expand(self, parent: int, children: list[tuple[list[int], list[float], bool]], final: bool = False) -> list[int]:
        """Add children ``(ids, logprobs, eos)`` under ``parent``; they join the candidates. Returns their ids.

        A child is terminal when it ends with EOS, reaches ``max_depth``, fills ``limit`` tokens, or is ``final`` (a
        completion to the end)."""
        self.candidates = [c for c in self.candidates if not self.nodes[c].final_backup]
        new = []
        base = len(self.path_ids(parent))
        for ids, lps, eos in children:
            depth = self.nodes[parent].depth + 1
            full = self.limit is not None and base + len(ids) >= self.limit
            node = Node(parent=parent, depth=depth, ids=list(ids), logprobs=list(lps), eos=bool(eos),
                        terminal=final or bool(eos) or full or depth >= self.o.max_depth)
            self.nodes.append(node)
            k = len(self.nodes) - 1
            self.nodes[parent].children.append(k)
            self.candidates.append(k)
            new.append(k)
        if not final:  # a completion of the fill is not a search node (its own count: the fill's rows)
            self.generated += len(children)
        return new

    def unjudged(self) -> list[int]:
        return [k for k, n in enumerate(self.nodes) if n.terminal and n.score is None]

    def judge(self, k: int, correct: bool) -> None:
        """Outcome of terminal node ``k``: +1 correct, ``incomplete_score`` when cut at the depth limit, else -1."""
        n = self.nodes[k]
        n.score = 1.0 if correct else (self.o.incomplete_score if not n.eos else -1.0)
        n.entropy = neg_mean(self.path_logprobs(k))

    # ------------------------------------------------------------------------------------ search
    def pending(self) -> tuple[int, int] | None:
        """``(node, count)``: children to generate next, or None when the search is over for this step."""
        for _ in range(4 * len(self.nodes) + 8):  # each pass backs up or moves; the guard ends a pathological loop
            if self.done:
                return None
            node = self.nodes[self.current]
            want = self.o.expansion_width - len(node.children)
            if want > 0:
                left = self.budget - self.generated
                if left <= 0:
                    self.stopped = True
                    return None
                return self.current, min(want, left)
            self.candidates = [c for c in node.children if not self.nodes[c].final_backup]
            self.backup_and_select()
        self.stopped = True
        return None

    def _update_recursive(self, k: int, outcome: float, traj_len: int) -> None:
        while k >= 0:
            n = self.nodes[k]
            n.visits += 1
            n.value = update_value(n.value, outcome, backup_weight(n.depth, traj_len, self.o.backup_threshold))
            k = n.parent

    def backup_and_select(self) -> None:
        """Back up the candidates (one terminal at most), record it, select the next node (official)."""
        if self.done:
            return
        terminals = [c for c in self.candidates if self.nodes[c].terminal]
        for c in self.candidates:
            if not self.nodes[c].terminal:
                self.nodes[c].visits += 1  # an intermediate node: visited, value unchanged
        if terminals:
            best = min(terminals, key=lambda c: terminal_rank(self.nodes[c].score, self.nodes[c].entropy))
            node = self.nodes[best]
            self._update_recursive(best, node.score, node.depth + 1)
            node.final_backup = True
            self.recorded.append(best)
        self.candidates = []
        if self.done:
            return
        if not terminals:
            child = self.select_child(self.current)
            if child is not None and not self.nodes[child].terminal:
                self.current = child
                return
        nxt = self.global_select()
        if nxt is None:
            self.stopped = True
        else:
            self.current = nxt

    def select_child(self, k: int) -> int | None:
        """The child of highest PUCT (terminal children last; the first on ties)."""
        node = self.nodes[k]
        best, best_s = None, -math.inf
        for c in node.children:
            child = self.nodes[c]
            s = -math.inf if child.terminal else puct(child.q(), child.visits, node.visits, self.o.lambda_puct)
            if best is None or s > best_s:
                best, best_s = c, s
        return best

    def frontier(self, full: bool = False) -> list[int]:
        """Non-terminal, non-root nodes in depth-first order (with fewer than ``expansion_width`` children unless
        ``full``), best global score first (a stable sort: the first in depth-first order on ties)."""
        order, stack = [], [0]
        while stack:
            k = stack.pop()
            order.append(k)
            stack.extend(reversed(self.nodes[k].children))
        nodes = [k for k in order if k > 0 and not self.nodes[k].terminal
                 and (full or len(self.nodes[k].children) < self.o.expansion_width)]
        return sorted(nodes, key=lambda k: -self._global(k))

    def _global(self, k: int) -> float:
        n = self.nodes[k]
        return global_score(self.nodes[n.parent].q(), n.q(), n.step_entropy(), n.depth, self.o)

    def global_select(self) -> int | None:
        nodes = self.frontier()
        return nodes[0] if nodes else None

    # ------------------------------------------------------------------------------------ rows
    def fill_from_tree(self) -> None:
        """Record the tree's unrecorded judged terminal paths (official order of preference) while rows are free."""
        spare = [k for k, n in enumerate(self.nodes) if n.terminal and n.score is not None and not n.final_backup]
        for k in sorted(spare, key=lambda k: terminal_rank(self.nodes[k].score, self.nodes[k].entropy)):
            if len(self.recorded) >= self.rows:
                return
            self.nodes[k].final_backup = True
            self.recorded.append(k)

    def fill_sources(self) -> list[int]:
        """Nodes to complete to the end for the rows still free: the best frontier nodes by the global score (all
        non-terminal nodes, cycled), or the root when the tree has none."""
        need = self.rows - len(self.recorded)
        if need <= 0:
            return []
        nodes = self.frontier(full=True) or [0]
        return [nodes[j % len(nodes)] for j in range(need)]

    def row_credit(self, k: int) -> tuple[list[int], list[float]]:
        """Step lengths and credit values of recorded path ``k`` (the leaf's value is its outcome)."""
        path = self.path(k)
        values = [self.nodes[j].value for j in path[:-1]] + [self.nodes[k].score]
        return [len(self.nodes[j].ids) for j in path], step_credit(values, self.o)


def cut_step(ids: list[int], step: int, delimiter: str | None, decode) -> int:
    """Tokens of the first step of a sampled completion: ``step`` at most, fewer when ``delimiter`` completes first
    (just after the token that completes it, as the seam's stop strings)."""
    n = min(step, len(ids))
    if delimiter is None or delimiter not in decode(ids[:n]):
        return n
    for j in range(1, n + 1):
        if delimiter in decode(ids[:j]):
            return j
    return n


def prompt_key(prompt) -> int:
    """The replay buffer's key of a prompt: 48 bits of the SHA-1 of its text or message list (exact in float64, so
    it travels in the gathered records)."""
    return int(hashlib.sha1(repr(prompt).encode()).hexdigest()[:12], 16)


# ============================================================================================ plugin
class DeepsearchPlugin(Plugin):
    """MCTS in the rollout: global frontier selection, confident terminal paths, tree-backed step credit."""

    name = "deepsearch"
    version = "0.1.0"
    paper = (
        "DeepSearch: Overcome the Bottleneck of Reinforcement Learning with Verifiable Rewards via Monte Carlo Tree "
        "Search, arXiv:2509.25454"
    )
    summary = "Group grown by tree search: global frontier selection, confident terminal paths, step credit from backup."
    Options = DeepsearchOptions
    image_inputs = True
    multi_turn = True
    official = OfficialSource(
        "smiles724/DeepSearch", "daf9067b87cf4229f364bd1ccd9136a6e8b68072", verdict="faithful",
        files=("deepsearch/utils/mcts.py", "deepsearch/rollout/sglang_mcts_wrapper.py",
               "deepsearch/reward_manager/advantage_fn.py", "deepsearch/register_replay_buffer.py", "round0.sh",
               "round1.sh"),
        note="Expansion, the entropy-guided terminal choice, the value backup, PUCT and global frontier selection, the "
        "step credit and its sibling normalisation follow the official code; the search runs through the branching "
        "seam after TRL's generation (row 0's own sample is the root's first child), with a node budget and a fill "
        "of the rows it leaves free; the replay buffer is built online.",
        variants=("step_delimiter", "std_normalize"),
    )
    claim_metric = ("tree_nodes", "nodes generated per tree and step (the search's compute)")
    reconstructed = (
        "node_budget caps the search; rows it leaves free come from unrecorded terminal paths, then from completing "
        "the best frontier nodes (not backed up)",
        "row 0's own TRL sample, cut after one step, is the root's first child",
        "the replay buffer is built online from this run's tree rows, in memory, and its groups keep TRL's advantage",
        "an unfinished path at the depth limit that is not correct scores incomplete_score (officially: unparsable)",
        "step_delimiter (a step also ends at a string) and weight (mix with TRL's advantages) are our options",
    )

    def __init__(self, options=None):
        super().__init__(options)
        self._pending = False
        self._cached: dict[int, list[list[int]]] = {}  # prompt key -> cached correct solutions (the replay buffer)
        self._step = 1

    # ----------------------------------------------------------------------------------------- checks
    def hook_enabled(self, hook: str) -> bool:
        return self.options.enabled

    def image_inputs_refusal(self) -> str | None:
        if self.options.enabled:
            return f"with weight={self.options.weight}, {IMAGES_GENERATION_SERVICE}"
        return None

    def multi_turn_refusal(self) -> str | None:
        if self.options.enabled:
            return ("DeepSearch's tree nodes are sampled through the branching seam, which samples single-turn text "
                    "without running tools; set weight=0 for tool rollouts.")
        return None

    @hookimpl
    def trl_plugins_configure(self, trainer, args):
        o = self.options
        if samples_outside_hf_generate(args):
            raise IncompatiblePluginsError(
                f"deepsearch with weight={o.weight} cannot run with use_vllm=True or continuous batching: "
                f"{VLLM_BRANCHING} Or set weight=0.")
        G = int(getattr(args, "num_generations", 0) or 0)
        if G and o.node_budget < G:
            _refuse("node_budget", o.node_budget, f"a budget >= num_generations={G} (each row is a path of the tree)")
        L = int(getattr(args, "max_completion_length", 0) or 0)
        if L and L // o.max_depth < 1:
            _refuse("max_depth", o.max_depth, f"at most max_completion_length={L} (a step is max_completion_length // "
                    "max_depth tokens)")
        self._step = max(L // o.max_depth, 1) if L else 1
        tokenizer = getattr(trainer, "text_tokenizer", None)
        if o.step_delimiter is not None and tokenizer is not None:
            s = o.step_delimiter
            text = tokenizer.decode(tokenizer.encode(s, add_special_tokens=False), skip_special_tokens=True)
            if s not in text:
                _refuse("step_delimiter", s, f"a string the policy's decoded text can contain (the tokenizer writes it "
                        f"as {text!r} once decoded, special tokens skipped)")

    # ----------------------------------------------------------------------------------------- prompt stage
    @hookimpl
    def trl_plugins_generation_prompts(self, ctx: PromptContext):
        """Defer every row but row 0 of each group whose prompt is not in the replay buffer."""
        for i in range(len(ctx.rows)):
            if ctx.index_in_group[i] != 0 and prompt_key(ctx.prompts[i]) not in self._cached:
                ctx.defer(i)
        self._pending = True  # on every process: the next hook's collectives run everywhere

    # ----------------------------------------------------------------------------------------- search
    @hookimpl
    def trl_plugins_after_generation(self, ctx: RolloutContext):
        """Search each group's tree (collective: the same calls on every process, see the module docstring)."""
        if not self._pending:  # e.g. a refill round: its rows were sampled independently
            return
        self._pending = False
        o, G, B = self.options, ctx.num_generations, len(ctx)
        keys = [prompt_key(ctx.prompts[i]) for i in range(B)]
        cached_groups = {ctx.group_ids[i] for i in range(B) if keys[i] in self._cached}
        home = {ctx.group_ids[i]: i for i in range(B)
                if ctx.index_in_group[i] == 0 and ctx.group_ids[i] not in cached_groups}
        trees = {g: SearchTree(o, G, o.node_budget, ctx.run.max_completion_length) for g in home}
        stats = {"iterations": 0, "filled_tree": 0, "filled_completed": 0}
        self._seed_roots(ctx, trees, home)
        while True:
            self._judge(ctx, trees, home)
            asks = []
            for g, t in trees.items():
                p = t.pending()
                if p is not None:
                    asks += [(g, p[0])] * p[1]
            if not self._any(ctx, len(asks)):  # the same decision on every process
                break
            stats["iterations"] += 1
            conts = ctx.continue_prefixes([list(ctx.prompt_ids[home[g]]) for g, _ in asks],
                                          [trees[g].path_ids(k) for g, k in asks], self._step,
                                          stop=[o.step_delimiter] if o.step_delimiter else None)
            grouped: dict[tuple[int, int], list] = {}
            for (g, k), c in zip(asks, conts):
                grouped.setdefault((g, k), []).append((list(c.new_ids), list(c.logprobs), self._eos(ctx, c)))
            for (g, k), children in grouped.items():
                trees[g].expand(k, children)
            self._judge(ctx, trees, home)
            for g, _k in grouped:
                trees[g].backup_and_select()
        self._fill(ctx, trees, home, stats)
        self._write_rows(ctx, trees, home, cached_groups, keys, stats)

    def _seed_roots(self, ctx, trees, home) -> None:
        """Row 0's own sample cut after its first step: the root's first child (one collective log-prob call when
        the backend reports no sampling log-probs)."""
        o, tok = self.options, ctx.tokenizer
        decode = lambda ids: tok.decode(ids, skip_special_tokens=True)  # noqa: E731
        cuts = {}
        for g, i in home.items():
            ids = list(ctx.completion_ids[i])
            n = cut_step(ids, self._step, o.step_delimiter, decode)
            # TRL stops at EOS or at the length limit: a sample shorter than one step ended (whatever its EOS id)
            cuts[g] = (ids[:n], n == len(ids) and (len(ids) < self._step or self._ends_with_eos(ctx, ids)))
        order = sorted(home)
        if ctx.sampling_logprobs is None:
            lps = ctx.policy_logprobs([ctx.prompt_ids[home[g]] for g in order], [cuts[g][0] for g in order])
            lps = {g: [float(x) for x in lp.tolist()] for g, lp in zip(order, lps)}
        else:
            lps = {g: [float(x) for x in ctx.sampling_logprobs[home[g]][:len(cuts[g][0])]] for g in order}
        for g in order:
            trees[g].expand(0, [(cuts[g][0], lps[g], cuts[g][1])])

    @staticmethod
    def _ends_with_eos(ctx, ids: list[int]) -> bool:
        eos = getattr(ctx.tokenizer, "eos_token_id", None)
        return bool(ids) and eos is not None and ids[-1] == eos

    def _eos(self, ctx, c) -> bool:
        """Whether a continuation ended the path: EOS (not a step delimiter, not a length cut)."""
        return bool(c.finished) and c.stop is None

    @staticmethod
    def _any(ctx, n: int) -> bool:
        return bool(gather_floats(ctx, [float(n)] * len(ctx)).nansum() > 0)

    def _judge(self, ctx, trees, home) -> None:
        """Judge every new terminal node of this process's trees with TRL's verifier column (local)."""
        todo = [(g, k) for g, t in trees.items() for k in t.unjudged()]
        if not todo:
            return
        rows = [home[g] for g, _ in todo]
        comps = [ctx.decode(trees[g].path_ids(k) or [ctx.tokenizer.eos_token_id], home[g]) for g, k in todo]
        verdict = ctx.success(rows, comps).tolist()
        for (g, k), ok in zip(todo, verdict):
            trees[g].judge(k, bool(ok))

    def _fill(self, ctx, trees, home, stats) -> None:
        """Rows the search left free: unrecorded terminal paths, then completed frontier nodes (one seam call)."""
        asks = []
        for g, t in trees.items():
            before = len(t.recorded)
            t.fill_from_tree()
            stats["filled_tree"] += len(t.recorded) - before
            asks += [(g, k) for k in t.fill_sources()]
        limit = ctx.run.max_completion_length
        prefixes = [trees[g].path_ids(k) for g, k in asks]
        conts = ctx.continue_prefixes([list(ctx.prompt_ids[home[g]]) for g, _ in asks], prefixes,
                                      [max(limit - len(p), 1) for p in prefixes])
        leaves = []
        for (g, k), c in zip(asks, conts):
            (leaf,) = trees[g].expand(k, [(list(c.new_ids), list(c.logprobs), self._eos(ctx, c))], final=True)
            leaves.append((g, leaf))
        self._judge(ctx, trees, home)
        for g, leaf in leaves:  # recorded without backup (reconstructed)
            trees[g].nodes[leaf].final_backup = True
            trees[g].recorded.append(leaf)
        stats["filled_completed"] += len(leaves)

    def _write_rows(self, ctx, trees, home, cached_groups, keys, stats) -> None:
        """Gather every group's rows (a group may straddle processes), write the local ones, update the buffer."""
        o, G, B = self.options, ctx.num_generations, len(ctx)
        # one flat record per path: [group, slot, prompt key, n_ids, ids..., n_steps, lengths..., values..., correct]
        flat: list[float] = []
        for g, t in trees.items():
            for s, k in enumerate(t.recorded[:G]):
                ids = t.path_ids(k) or [ctx.tokenizer.eos_token_id]
                lengths, values = t.row_credit(k)
                flat += [g, s, keys[home[g]], len(ids), *ids, len(lengths), *lengths, *values,
                         float(t.nodes[k].score == 1)]
        local = torch.tensor(flat + [-1.0], dtype=torch.float64)  # -1: end of this process's records
        gathered = ctx.gather_padded(local.to(context_device(ctx)), dim=0, pad_value=float("nan")).cpu().tolist()
        paths: dict[tuple[int, int], tuple[list[int], list[int], list[float], bool]] = {}
        group_keys: dict[int, int] = {}
        j = 0
        while j < len(gathered):
            x = gathered[j]
            if math.isnan(x) or x < 0:
                j += 1
                continue
            g, s, group_keys[int(x)], n = int(x), int(gathered[j + 1]), int(gathered[j + 2]), int(gathered[j + 3])
            ids = [int(v) for v in gathered[j + 4:j + 4 + n]]
            j += 4 + n
            m = int(gathered[j])
            lengths = [int(v) for v in gathered[j + 1:j + 1 + m]]
            values = [float(v) for v in gathered[j + 1 + m:j + 1 + 2 * m]]
            correct = bool(gathered[j + 1 + 2 * m])
            j += 2 + 2 * m
            paths[(g, s)] = (ids, lengths, values, correct)
        for i in range(B):
            g, s = ctx.group_ids[i], ctx.index_in_group[i]
            if g in cached_groups:
                sols = self._cached[keys[i]]
                if s < len(sols):
                    ctx.replace_row(i, list(sols[s]))
                ctx.annotations[i][CACHED_KEY] = True
                continue
            ids, lengths, values, _ = paths[(g, s)]
            ctx.replace_row(i, ids)
            ctx.annotations[i].update({LENGTHS_KEY: lengths, VALUES_KEY: values})
        if o.replay_buffer:
            self.register(paths, group_keys, G)
        nodes = [t.generated for t in trees.values()]
        ctx.log_metric("tree_nodes", sum(nodes) / max(len(nodes), 1))
        ctx.log_metric("search_iterations", float(stats["iterations"]))
        ctx.log_metric("rows_filled_from_tree", float(stats["filled_tree"]))
        ctx.log_metric("rows_filled_by_completion", float(stats["filled_completed"]))
        ctx.log_metric("cached_groups", float(len(cached_groups)))
        ctx.log_metric("buffer_size", float(len(self._cached)))
        ctx.log_metric("tree_correct_fraction", sum(p[3] for p in paths.values()) / max(len(paths), 1))

    def register(self, paths: dict, group_keys: dict[int, int], G: int) -> None:
        """Official registration: a prompt solved in ``(0, buffer_threshold]`` of its tree rows keeps its correct
        solutions (``paths``: ``(group, slot) -> (ids, lengths, values, correct)``, every group of the batch)."""
        for g in sorted(group_keys):
            rows = [paths[(g, s)] for s in range(G) if (g, s) in paths]
            solved = [p[0] for p in rows if p[3]]
            frac = len(solved) / max(len(rows), 1)
            if 0 < frac <= self.options.buffer_threshold and group_keys[g] not in self._cached:
                self._cached[group_keys[g]] = solved

    # ----------------------------------------------------------------------------------------- advantages
    @hookimpl
    def trl_plugins_transform_advantages(self, ctx: AdvantageContext):
        o = self.options
        if ctx.mode != "train":
            return
        mask = ctx.completion_mask()
        N, width = mask.shape
        has = torch.tensor([LENGTHS_KEY in note for note in ctx.annotations], dtype=torch.bool)
        if not bool(has.any()):
            return
        lengths = [list(note.get(LENGTHS_KEY, [])) for note in ctx.annotations]
        values = [list(note.get(VALUES_KEY, [])) for note in ctx.annotations]
        groups = [int(g) if h else -1 - n for n, (g, h) in enumerate(zip(ctx.pool_ids().tolist(), has.tolist()))]
        ds = credit_advantages(lengths, values, groups, width, o.std_normalize)
        adv = ctx.advantages.float().cpu()
        base = adv[:, :width] if adv.dim() == 2 else adv.unsqueeze(1).expand(-1, width)
        ctx.add_token_advantages(torch.where(has.unsqueeze(1), ds - base, torch.zeros_like(base)), o.weight)
        trained = has.unsqueeze(1) & mask.bool().cpu()
        ctx.log_metric("credit_abs_mean", float(ds[trained].abs().mean()) if trained.any() else 0.0)

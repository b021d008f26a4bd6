"""ARES's reasoning-trigger vocabulary: the words whose tokens can open a high-window-entropy (HWE) window.

Data of the official repository shawn0728/ARES @146620e, ``data/crucial_token_final_version.json`` (Apache-2.0, the
repository's LICENSE), in its order (174 words). A token matches when its decoded text, with leading ``\u2581`` /
``\u0120`` markers and surrounding whitespace removed and lower-cased, is one of these words (the official
``normalize_token``).
"""

TRIGGER_WORDS: tuple[str, ...] = (
    'clarify', 'realize', 'initially', 'reconsider', 'explore', 'describe', 'unless', 'whereas', 'explain', 'rather',
    'possibly', 'according', 'infer', 'evaluates', 'indicating', 'besides', 'recap', 'inferred', 'justify', 'actually',
    'reflect', 'thereby', 'especially', 'presumably', 'observe', 'derive', 'meanwhile', 'validate', 'balancing',
    'begin', 'if', 'albeit', 'important', 'leads', 'rational', 'let', 'clue', 'since', 'consider', 'though', 'reasoned',
    'definitely', 'implication', 'unclear', 'therefore', 'reason', 'resolve', 'solve', 'uncertainty', 'critical',
    'instead', 'assume', 'explanation', 'further', 'elaborate', 'next', 'no', 'technically', 'thinking', 'consequence',
    'moreover', 'recalling', 'equivalence', 'structure', 'insight', 'neither', 'acknowledging', 'alternatively',
    'indeed', 'hence', 'perhaps', 'uncertain', 'somehow', 'ascertain', 'simultaneously', 'analogy', 'conject',
    'challenging', 'hints', 'extend', 'proof', 'speculation', 'apparently', 'crucial', 'specifically', 'explains',
    'contradict', 'reflecting', 'logically', 'clearly', 'excluding', 'surprising', 'suggest', 'now', 'alternative',
    'otherwise', 'difference', 'hint', 'recall', 'explained', 'anyway', 'assumptions', 'think', 'visualization',
    'emphasizing', 'converge', 'assumes', 'depends', 'implies', 'but', 'should', 'however', 'interpret', 'decide',
    'indicates', 'although', 'choose', 'analyzing', 'backtrack', 'unsure', 'honestly', 'yet', 'suggesting', 'conflicts',
    'strategy', 'rethink', 'reasoning', 'thought', 'caused', 'cause', 'remember', 'considering', 'reconcile',
    'unlikely', 'reflection', 'suggests', 'until', 'hypothesis', 'because', 'hypothetical', 'reject', 'revisit',
    'consequently', 'either', 'analysis', 'when', 'eliminate', 'thus', 'why', 'conclude', 'recognizing', 'implied',
    'interpreting', 'try', 'denote', 'sometimes', 'imply', 'puzzle', 'conversely', 'maybe', 'suppose', 'expectation',
    'realistically', 'likely', 'logic', 'solving', 'assuming', 'whether', 'discrepancy', 'hmm', 'wait', 'guess',
    'seems', 'imagine'
)

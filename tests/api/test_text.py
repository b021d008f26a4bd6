"""trl_plugins.api.text: completion text and stable keys."""

from trl_plugins.api.text import completion_text, stable_key


def test_completion_text_of_a_string_and_of_messages():
    assert completion_text("Answer: 4") == "Answer: 4"
    assert completion_text([{"role": "assistant", "content": "Answer: 4"}]) == "Answer: 4"


def test_stable_key_ignores_key_order_and_distinguishes_values():
    a = [{"role": "user", "content": "Q0"}]
    assert stable_key(a) == stable_key([{"content": "Q0", "role": "user"}])
    assert stable_key(a) != stable_key([{"role": "user", "content": "Q1"}])
    assert -(2**63) <= stable_key("Q0") < 2**63
    # fixed across processes and runs (not Python's salted hash): a pinned value
    assert stable_key("Q0") == 9174744975080465463

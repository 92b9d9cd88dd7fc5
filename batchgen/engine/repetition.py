"""A row caught in a loop: its output's tail is one short pattern repeated. Pure Python, used by both
engines after each token (the native engine's output processor; the vLLM engine, which aborts the
row in vLLM), so a looping row ends the same way on either, with finish_reason "repetition".

The rule: the last `span` tokens are a pattern of L tokens (1 <= L <= MAX_PATTERN) repeated, where
span = L * max(MIN_REPEATS, ceil(MIN_SPAN / L)). A short pattern must fill MIN_SPAN tokens (one token
64 times, "0 0 0 ..." inside a long number or a rule of dashes does not), a long one must come back
MIN_REPEATS times (a 40-token sentence three times in a row). vLLM's own `repetition_detection` asks
one repeat count of every length, which cannot be strict for one token and prompt for a sentence at
once, so batchgen applies this rule itself on both engines.
"""

from __future__ import annotations

from collections.abc import Sequence

MAX_PATTERN = 64  # tokens: longer loops (a paragraph) are left to max_tokens
MIN_SPAN = 64  # tokens the repeated tail covers at least
MIN_REPEATS = 3  # times a pattern comes back at least


def repeats_needed(length: int) -> int:
    return max(MIN_REPEATS, -(-MIN_SPAN // length))


def looping(tokens: Sequence[int]) -> int:
    """The length of the shortest pattern whose repeats fill the tail of `tokens` as the rule asks, or
    0. Cheap where there is no loop: each length is dropped at its first mismatch, mostly the first."""
    n = len(tokens)
    for length in range(1, MAX_PATTERN + 1):
        span = length * repeats_needed(length)
        if span > n:
            continue  # a longer pattern may still fit: spans are not monotone in the length
        # periodic with period `length` over the last `span` tokens: t[i] == t[i - length]
        if all(tokens[i] == tokens[i - length] for i in range(n - 1, n - span + length - 1, -1)):
            return length
    return 0

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


SPANS = (0,) + tuple(length * repeats_needed(length) for length in range(1, MAX_PATTERN + 1))  # by length
SHORTEST = min(SPANS[1:])  # no tail shorter than this can loop


def looping(tokens: Sequence[int]) -> int:
    """The length of the shortest pattern whose repeats fill the tail of `tokens` as the rule asks, or
    0. It runs after every token of every row, so it asks little of a row that is not looping: a
    pattern of length L needs the last token to have come L tokens before, so only the places where
    it came in the MAX_PATTERN tokens before it are tried, each as one slice comparison."""
    n = len(tokens)
    if n < SHORTEST:
        return 0
    last = tokens[-1]
    before = tokens[max(0, n - 1 - MAX_PATTERN):n - 1][::-1]  # the tokens before the last, nearest first
    k = -1
    while True:  # each earlier place of the last token, nearest first: a pattern length to try
        try:
            k = before.index(last, k + 1)
        except ValueError:
            return 0
        length, span = k + 1, SPANS[k + 1]
        # periodic with period `length` over the last `span` tokens: t[i] == t[i - length]
        if span <= n and tokens[n - span + length:] == tokens[n - span:n - length]:
            return length

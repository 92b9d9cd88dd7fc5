"""N-gram (prompt-lookup) speculation: draft tokens copied from the request's own context.

Pure Python, no torch. For a decoding request, the proposer looks for the last `n` tokens (n from
`max_n` down to `min_n`) earlier in the prompt + output, and proposes the up-to-k tokens that
followed their latest occurrence (vLLM's `ngram` method, after Saxena's prompt lookup decoding).
The target model then scores the last token and the drafts in one pass; the runner samples every
position with the request's own seed and token counter, and the drafts are kept up to the first
that differs from what was sampled. So the output is exactly what decoding without speculation
would produce, greedy or seeded: speculation changes only how many passes it takes.

Each request's index is kept up to date as tokens arrive (dict per n: n-gram -> its latest start),
so a proposal costs O(max_n), not a scan of the context.
"""

from __future__ import annotations


class NgramIndex:
    __slots__ = ("maps", "upto")

    def __init__(self, max_n: int):
        self.maps: list[dict[tuple[int, ...], int]] = [{} for _ in range(max_n + 1)]
        self.upto = 0  # n-grams starting before this position whose continuation is known are indexed


class NgramProposer:
    def __init__(self, num_tokens: int, min_n: int = 2, max_n: int = 4):
        if num_tokens < 1 or not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram speculation needs k >= 1 and 1 <= min_n <= max_n ({num_tokens=}, {min_n=}, {max_n=})")
        self.k, self.min_n, self.max_n = num_tokens, min_n, max_n
        self._index: dict[str, NgramIndex] = {}

    def propose(self, request_id: str, tokens: list[int], limit: int) -> list[int]:
        """Up to min(k, limit) draft tokens to follow `tokens` (the request's prompt + output)."""
        limit = min(self.k, limit)
        if limit <= 0:
            return []
        idx = self._index.get(request_id)
        if idx is None:
            idx = self._index[request_id] = NgramIndex(self.max_n)
        L = len(tokens)
        # index every n-gram that has a following token, i.e. starts at i with i + n < L; those ending
        # at the very end are the suffix being looked up, added once the next token arrives
        for i in range(idx.upto, L):
            for n in range(self.min_n, self.max_n + 1):
                if i + n < L:
                    idx.maps[n][tuple(tokens[i:i + n])] = i
        idx.upto = max(idx.upto, L - self.max_n)
        for n in range(self.max_n, self.min_n - 1, -1):
            if n > L:
                continue
            start = idx.maps[n].get(tuple(tokens[L - n:]))
            if start is not None:
                return tokens[start + n:start + n + limit]
        return []

    def drop(self, request_id: str) -> None:
        self._index.pop(request_id, None)

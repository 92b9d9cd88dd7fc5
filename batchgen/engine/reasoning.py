"""Reasoning models: the thought kept apart from the answer, and a budget for it. Pure Python over
token ids; both engines use it (the native engine's output processor, the vLLM engine's step).

A thinking model writes `<think> ... </think>` before its answer (Qwen3, QwQ, DeepSeek-R1, SmolLM3), or
its chat template opens the thought in the prompt and the model only closes it (DeepSeek-R1's). The
markers are read from the model's own chat template and vocabulary, never assumed: a model whose
template names no known pair, or whose vocabulary lacks them as single tokens, has no reasoning
(every output is answer). A row's output splits at the first end marker: before it the reasoning
(its tokens counted with both markers), after it the answer. A row cut before its thought ended is
all reasoning, with an empty answer.

The budget (`max_reasoning_tokens`): a thought is at most that many tokens, its end marker included,
as vLLM's `thinking_token_budget` counts them. Where a row would run past it, the thought is closed for
it (on the native engine a newline and the end marker, then a blank line: what the model writes
itself; vLLM writes the end marker) and its answer begins.
"""

from __future__ import annotations

from dataclasses import dataclass

PAIRS = (("<think>", "</think>"),)  # the start and end markers batchgen knows


@dataclass(frozen=True)
class ThinkMarkers:
    start: str
    end: str
    start_id: int
    end_id: int
    close_ids: tuple[int, ...]  # what the budget writes to close a thought

    @property
    def close_to_end(self) -> int:
        """The close's tokens up to and with its end marker."""
        return self.close_ids.index(self.end_id) + 1

    def in_thought_after(self, prompt_ids: list[int]) -> bool:
        """Whether the prompt leaves the model inside a thought (a template that opens it)."""
        last = {self.start_id: -1, self.end_id: -1}
        for i, t in enumerate(prompt_ids):
            if t in last:
                last[t] = i
        return last[self.start_id] > last[self.end_id]


def markers_of(template_source: str | None, token_id, encode) -> ThinkMarkers | None:
    """The model's think markers: a known pair its chat template names and its vocabulary holds as
    single tokens (`token_id(text) -> int | None`; `encode(text) -> ids`), or None."""
    for start, end in PAIRS:
        if template_source and start in template_source and end in template_source:
            sid, eid = token_id(start), token_id(end)
            if sid is not None and eid is not None:
                close = tuple(encode(f"\n{end}\n\n"))
                return ThinkMarkers(start, end, sid, eid, close if eid in close else (eid,))
    return None


@dataclass
class Thought:
    """One row's reasoning as its tokens come: whether it is thinking, how long, and what the budget
    still forces."""

    markers: ThinkMarkers
    thinking: bool  # inside a thought now
    budget: int | None = None
    tokens: int = 0  # of the thought so far, markers included
    closed_at: int | None = None  # output index just past the end marker
    forced: list[int] | None = None

    @property
    def cut(self) -> bool:
        """The budget ended the thought: it reached the budget, end marker included."""
        length = self.closed_at if self.closed_at is not None else self.tokens
        return self.budget is not None and length >= self.budget

    def next_token(self, sampled: int) -> int:
        """The token the row takes: the sampled one, or the budget's next closing token."""
        if self.forced:
            return self.forced.pop(0)
        return sampled

    def took(self, token: int, index: int) -> None:
        """Account for output token `index`, once taken."""
        m = self.markers
        if self.closed_at is not None:
            return
        if not self.thinking and index == 0 and token == m.start_id:
            self.thinking = True
        if not self.thinking:
            self.closed_at = 0  # the model answered without a thought: nothing more to watch
            return
        self.tokens += 1
        if token == m.end_id:  # what the budget forces after the marker still follows
            self.thinking, self.closed_at = False, index + 1
            return
        if self.budget is not None and self.forced is None and self.tokens + m.close_to_end >= self.budget:
            self.forced = list(m.close_ids)  # the end marker lands on the budget's last token

    def split(self, output_ids: list[int], decode) -> tuple[str | None, str, int]:
        """(reasoning text or None, answer text, reasoning tokens) of a finished row."""
        m = self.markers
        if not self.thinking and not self.closed_at:  # no thought: answer from the first token (or none)
            return None, decode(output_ids), 0
        end = self.closed_at if self.closed_at is not None else len(output_ids)
        body = [t for t in output_ids[:end] if t not in (m.start_id, m.end_id)]
        return decode(body).strip(), decode(output_ids[end:]).lstrip(), end

"""Structured output for the native engine: xgrammar (the grammar library vLLM uses) constrains the
tokens of requests that carry a spec (batchgen.data.response_format) to a JSON schema, any JSON, a
regex or a choice.

Each constrained request has a GrammarMatcher. Before sampling, its row of the logits is masked to
the tokens the grammar allows next; after, the chosen token advances the matcher. A request whose
grammar is complete may only stop, and stops. Equal specs share one compiled grammar. Whitespace
between JSON tokens is not free-form (vLLM's disable_any_whitespace), so a small model cannot wander
into endless blanks.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch


class GrammarConstraints:
    def __init__(self, model_dir: str | Path, vocab_size: int, stop_token_ids: list[int]):
        self.model_dir = Path(model_dir)
        self.vocab_size = vocab_size
        self.stop_token_ids = stop_token_ids
        self.matchers: dict[str, object] = {}  # request id -> xgrammar.GrammarMatcher
        self._bitmask = None

    @functools.cached_property
    def _compiler(self):
        import xgrammar as xgr
        from transformers import PreTrainedTokenizerFast

        tok = PreTrainedTokenizerFast(tokenizer_file=str(self.model_dir / "tokenizer.json"))
        info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids)
        return xgr.GrammarCompiler(info)

    @functools.lru_cache(maxsize=256)
    def _compiled(self, spec: str):
        d = json.loads(spec)
        c = self._compiler
        if "json" in d:
            return c.compile_json_schema(json.dumps(d["json"]), any_whitespace=False)
        if "json_object" in d:
            return c.compile_builtin_json_grammar()
        if "regex" in d:
            return c.compile_regex(d["regex"])
        return c.compile_grammar("root ::= " + " | ".join(json.dumps(x) for x in d["choice"]))

    def add(self, request_id: str, spec: str) -> None:
        """Compile (or reuse) the spec's grammar; raises ValueError for one xgrammar cannot compile."""
        import xgrammar as xgr

        try:
            compiled = self._compiled(spec)
        except Exception as e:  # noqa: BLE001 - xgrammar raises several types for bad schemas and regexes
            raise ValueError(f"invalid response_format: {type(e).__name__}: {e}") from None
        self.matchers[request_id] = xgr.GrammarMatcher(compiled)

    def drop(self, request_id: str) -> None:
        self.matchers.pop(request_id, None)

    def mask(self, logits: torch.Tensor, request_ids: list[str]) -> None:
        """Mask, in place, each constrained row of logits [R, V] to the tokens its grammar allows."""
        import xgrammar as xgr

        rows = [i for i, rid in enumerate(request_ids) if rid in self.matchers]
        if not rows:
            return
        if self._bitmask is None or self._bitmask.shape[0] < len(request_ids):
            self._bitmask = xgr.allocate_token_bitmask(max(len(request_ids), 64), self.vocab_size)
        for i in rows:
            self.matchers[request_ids[i]].fill_next_token_bitmask(self._bitmask, i)
        xgr.apply_token_bitmask_inplace(logits, self._bitmask.to(logits.device), vocab_size=self.vocab_size,
                                        indices=rows)

    def accept(self, request_id: str, token: int) -> bool:
        """Advance the request's matcher; True once its grammar is complete (the request stops)."""
        m = self.matchers.get(request_id)
        if m is None:
            return False
        m.accept_token(token)
        return m.is_terminated()

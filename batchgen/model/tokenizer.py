"""Tokenizer + chat template from a local HF directory (tokenizers + jinja2, no transformers import)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from batchgen.model.loader import ModelLoadError


class Tokenizer:
    """Encodes prompts, renders chat messages with the model's template, decodes outputs."""

    def __init__(self, model_dir: str | Path):
        from tokenizers import Tokenizer as HFTokenizer

        d = Path(model_dir)
        path = d / "tokenizer.json"
        if not path.is_file():
            raise ModelLoadError(f"missing tokenizer.json in model directory {d}")
        self._tok = HFTokenizer.from_file(str(path))
        cfg_path = d / "tokenizer_config.json"
        self._cfg: dict[str, Any] = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        template = self._cfg.get("chat_template")
        tpl_path = d / "chat_template.jinja"
        if tpl_path.is_file():
            template = tpl_path.read_text()
        self._template_src = template
        self._template = None
        self._specials: tuple[str, ...] | None = None  # the added special tokens' texts, read on first use

    @property
    def has_chat_template(self) -> bool:
        return bool(self._template_src)

    @property
    def template_source(self) -> str | None:
        return self._template_src

    def token_id(self, text: str) -> int | None:
        """The id of `text` where the vocabulary holds it as one token."""
        return self._tok.token_to_id(text)

    def is_rendered(self, text: str) -> bool:
        """Whether `text` already holds a special token of this tokenizer (a chat turn's marker such as
        <|im_start|>, a BOS): a prompt that was rendered with a template before it came here."""
        if self._specials is None:
            self._specials = tuple(t.content for t in self._tok.get_added_tokens_decoder().values()
                                   if t.special and len(t.content) > 1)
        return any(s in text for s in self._specials)

    def _special(self, key: str) -> str:
        v = self._cfg.get(key)
        return v.get("content", "") if isinstance(v, dict) else (v or "")

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], keep_special: bool = False) -> str:
        """The text of `ids`; `keep_special`: with the template's special tokens (a rendered prompt)."""
        return self._tok.decode(ids, skip_special_tokens=not keep_special)

    def apply_chat_template(self, messages: list[dict[str, str]], **kwargs: Any) -> str:
        """Render messages the way transformers' apply_chat_template(add_generation_prompt=True) does;
        `kwargs` (chat_template_kwargs, e.g. enable_thinking) are template variables."""
        if not self._template_src:
            raise ModelLoadError("this model has no chat template, so a 'messages' column cannot be used")
        if self._template is None:
            from jinja2.exceptions import TemplateError
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            def raise_exception(message):
                raise TemplateError(message)

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=["jinja2.ext.loopcontrols"])
            env.filters["tojson"] = lambda x, **kw: json.dumps(x, ensure_ascii=False, **kw)
            env.globals["raise_exception"] = raise_exception
            self._template = env.from_string(self._template_src)
        return self._template.render(**{"add_generation_prompt": True, **kwargs}, messages=messages,
                                     bos_token=self._special("bos_token"), eos_token=self._special("eos_token"))

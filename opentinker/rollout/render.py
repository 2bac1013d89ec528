"""Text -> tokens for a seat: the chat template, the explicit system prompt, and the delta
tokens that extend a seat's running sequence turn by turn (../shared/DESIGN.md §6).

Games stay text; this is the one place that tokenizes. It uses the ``tokenizers`` library and
the model folder's Jinja chat template directly (rendered in a sandbox, like transformers),
so env runners and the coordinator never import torch.

How a turn's observation tokens are found: the conversation so far is rendered with every
earlier reply replaced by a sentinel, then again with the new user message and the
generation prompt. The second rendering must extend the first (checked); the new tokens are
what the template puts after the last reply (minus the stop token, which was sampled and is
already in the sequence) followed by the new user turn. The sampled tokens themselves are
kept exactly as drawn: nothing is decoded and re-encoded for training.

Tools (:mod:`games.tools`): a seat with tools renders their declarations through the template's
``tools=`` where the template uses it (:attr:`ChatTokenizer.supports_tools`, found by rendering
with and without a probe tool), else as :func:`games.tools.tool_instructions` after the system
prompt; a tool's result is a ``tool`` message (``observe(text, role="tool")``).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from games.tools import tool_instructions

_SENTINEL = "\x00REPLY\x00"


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    import jinja2

    raise jinja2.exceptions.TemplateError(message)


class ChatTokenizer:
    """A model folder's tokenizer and chat template, without transformers or torch."""

    def __init__(self, folder: str | Path) -> None:
        import jinja2.sandbox
        import tokenizers

        folder = Path(folder)
        if not (folder / "tokenizer.json").is_file():
            raise FileNotFoundError(f"{folder} has no tokenizer.json")
        self.tokenizer = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
        config = json.loads((folder / "tokenizer_config.json").read_text())
        template = config.get("chat_template")
        if (folder / "chat_template.jinja").is_file():
            template = (folder / "chat_template.jinja").read_text()
        if not template:
            raise ValueError(f"{folder} has no chat template")
        import jinja2.ext

        env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                           extensions=[jinja2.ext.loopcontrols])
        # As transformers does: templates with tools call tojson, and Jinja's own escapes HTML.
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        self._template = env.from_string(template)
        self.eos_token: str = config["eos_token"]
        self.eos_id: int = self.tokenizer.token_to_id(self.eos_token)
        self.bos_token: str | None = config.get("bos_token")
        pad = config.get("pad_token") or self.eos_token
        self.pad_id: int = self.tokenizer.token_to_id(pad)
        self.vocab_size = self.tokenizer.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; special-token strings in it become their ids."""
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(map(int, ids)), skip_special_tokens=skip_special_tokens)

    def render(self, messages: list[dict[str, str]], add_generation_prompt: bool,
               tools: Sequence[Mapping[str, Any]] | None = None) -> str:
        """The conversation as the template writes it; ``tools``: the OpenAI-shaped declarations
        passed as the template's ``tools`` (as ``apply_chat_template(tools=...)`` does)."""
        extra = {"tools": list(tools)} if tools else {}
        return self._template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token,
            **extra,
        )

    @functools.cached_property
    def supports_tools(self) -> bool:
        """Whether the chat template renders ``tools=`` (it writes something different with a
        probe declaration than without)."""
        probe = [{"type": "function", "function": {"name": "probe_tool", "description": "probe",
                                                   "parameters": {"type": "object", "properties": {}}}}]
        chat = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
        return self.render(chat, True, probe) != self.render(chat, True)


class SeatRenderer:
    """The running token sequence of one seat in one episode.

    Call :meth:`observe` with each observation text (it returns the new mask-0 tokens and
    extends the sequence), then :meth:`add_reply` with the sampled tokens. ``tools``: the seat's
    tool declarations (OpenAI shape), rendered by the template or after the system prompt.
    """

    def __init__(self, tok: ChatTokenizer, system_prompt: str,
                 tools: Sequence[Mapping[str, Any]] = ()) -> None:
        if not system_prompt:
            # SmolLM2's template injects its own system prompt when none is given.
            raise ValueError("the system prompt must be explicit (non-empty)")
        self.tok = tok
        self.tools = list(tools) if tools and tok.supports_tools else None
        if tools and self.tools is None:
            system_prompt = f"{system_prompt}\n\n{tool_instructions(tools)}"
        self.messages: list[dict[str, str]] = [{"role": "system", "content": system_prompt}]
        self.tokens: list[int] = []
        self._last_stopped = True

    def observe(self, text: str, role: str = "user") -> np.ndarray:
        """Append a ``role`` message (``user``, or ``tool`` for a tool's result); return its
        delta tokens ``int32[O]`` (mask 0)."""
        message = {"role": role, "content": text}
        if len(self.messages) == 1:
            rendered = self.tok.render(self.messages + [message], True, self.tools)
            delta = self.tok.encode(rendered)
        else:
            prev = self.tok.render(self.messages, False, self.tools)
            self.messages.append(message)
            full = self.tok.render(self.messages, True, self.tools)
            self.messages.pop()
            if not full.startswith(prev):
                raise ValueError("chat template does not preserve the prefix of the conversation")
            after_reply = prev[prev.rindex(_SENTINEL) + len(_SENTINEL):]
            if self._last_stopped and after_reply.startswith(self.tok.eos_token):
                after_reply = after_reply[len(self.tok.eos_token):]
            delta = self.tok.encode(after_reply + full[len(prev):])
        self.messages.append(message)
        self.tokens.extend(delta)
        return np.asarray(delta, dtype=np.int32)

    def add_reply(self, sampled: Sequence[int], stopped: bool) -> None:
        """Append the reply exactly as sampled (``stopped``: it ends with the stop token)."""
        self.messages.append({"role": "assistant", "content": _SENTINEL})
        self.tokens.extend(int(t) for t in sampled)
        self._last_stopped = stopped

    def prompt(self) -> np.ndarray:
        """The whole sequence so far, ``int32[T]``: what the model is asked to continue."""
        return np.asarray(self.tokens, dtype=np.int32)

"""Token ids to the text of an OpenAI choice: incremental decoding that never splits a
character, stop strings that may span tokens, and each token's exact bytes (for the
``logprobs`` entries); and the sampling of a reply as the endpoint and ``opentinker infer``
ask for it (:func:`reply_params`)."""

from __future__ import annotations

import bisect

import numpy as np

from opentinker.rollout.render import ChatTokenizer
from protocols.messages import SampleResult, SamplingParams, StopReason


def reply_params(temperature: float | None, top_p: float | None, top_k: int | None, max_tokens: int, eos_id: int,
                 seed: int) -> SamplingParams:
    """A reply's sampling: ``temperature`` 0 is greedy (temperature 1 with ``top_k`` 1),
    ``None`` the default; the tokenizer's eos ends the reply."""
    greedy = temperature == 0
    return SamplingParams(temperature=1.0 if greedy or temperature is None else temperature,
                          top_p=1.0 if top_p is None else top_p, top_k=1 if greedy else top_k or 0,
                          max_tokens=max_tokens, stop_token_ids=(eos_id,), seed=seed)


def _byte_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet: character -> the byte it stands for."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    rest = [b for b in range(256) if b not in bs]  # shifted past 255, in order
    return {chr(c): b for b, c in zip(bs + rest, bs + [256 + i for i in range(len(rest))])}


class TokenText:
    """The tokenizer, with each token's exact bytes (a byte-level BPE token may hold part of a
    character; with another decoder: the token decoded alone)."""

    def __init__(self, model_path: str) -> None:
        import tokenizers.decoders

        self.tok = ChatTokenizer(model_path)
        self._alphabet = _byte_alphabet() if isinstance(self.tok.tokenizer.decoder, tokenizers.decoders.ByteLevel) else {}
        self._bytes: dict[int, bytes] = {}

    def bytes_of(self, token_id: int) -> bytes:
        if (b := self._bytes.get(token_id)) is None:
            piece = self.tok.tokenizer.id_to_token(token_id) or ""
            b = (bytes(self._alphabet[ch] for ch in piece) if self._alphabet and all(ch in self._alphabet for ch in piece)
                 else self.tok.decode([token_id], skip_special_tokens=False).encode())
            self._bytes[token_id] = b
        return b


class ChoiceText:
    """One choice: its drawn tokens decoded incrementally (the text grows by whole characters),
    ended by a stop token, ``max_tokens`` or the first stop string (the text cut before it)."""

    def __init__(self, tok: ChatTokenizer, stops: list[str], max_tokens: int) -> None:
        self.tok, self.stops, self.max_tokens = tok, stops, max_tokens
        self.ids: list[int] = []
        self.logprobs: list[float] = []
        self.offsets: list[int] = []
        """Per kept token, where its text starts in :attr:`text`."""
        self.text = ""
        self.drawn = 0
        """Tokens drawn (the stop token too): the choice's ``completion_tokens``."""
        self.finish: str | None = None
        self.cut = False
        """Ended by a stop string (the scheduler may still be drawing)."""
        self.reported = False
        self._prefix = self._read = self._checked = self._sent_chars = self._sent_tokens = 0
        self._hold = max((len(s) for s in stops), default=1) - 1

    def push(self, tokens_T: np.ndarray, logprobs_T: np.ndarray) -> None:
        """Take newly drawn tokens (those after the row ended are ignored)."""
        for t, lp in zip(tokens_T.tolist(), logprobs_T.tolist()):
            if self.finish:
                return
            self.drawn += 1
            if t == self.tok.eos_id:
                return self.end(StopReason.STOP)
            self.offsets.append(len(self.text))
            self.ids.append(t)
            self.logprobs.append(lp)
            self._decode(final=False)
            self._find_stop()
        if self.drawn >= self.max_tokens:
            self.end(StopReason.LENGTH)

    def end(self, reason: StopReason) -> None:
        """The row ended for ``reason``, unless the rest of its text holds a stop string."""
        if not self.finish:
            self._decode(final=True)
            self.finish = "stop" if self._find_stop() else reason.value

    def _decode(self, final: bool) -> None:
        # Decode from some tokens back (vLLM's prefix/read offsets), so that a tokenizer that
        # strips a leading space or merges across tokens gives the text of decoding all at once.
        prev = self.tok.decode(self.ids[self._prefix:self._read])
        full = self.tok.decode(self.ids[self._prefix:])
        if len(full) > len(prev) and (final or not full.endswith("\ufffd")):
            self.text += full[len(prev):]
            self._prefix, self._read = self._read, len(self.ids)

    def _find_stop(self) -> bool:
        start, self._checked = max(0, self._checked - self._hold), len(self.text)
        hits = [i for s in self.stops if (i := self.text.find(s, start)) >= 0]
        if self.finish or not hits:
            return False
        cut = min(hits)
        keep = bisect.bisect_left(self.offsets, cut)
        self.text = self.text[:cut]
        del self.ids[keep:], self.logprobs[keep:], self.offsets[keep:]
        self.finish, self.cut = "stop", True
        return True

    def take(self) -> tuple[str, range]:
        """The text not taken yet, and the indices of the tokens that start in it: all of it once
        the row ended, else all but the last characters that could begin a stop string."""
        end = len(self.text) if self.finish else max(self._sent_chars, len(self.text) - self._hold)
        n = len(self.ids) if self.finish else bisect.bisect_left(self.offsets, end)
        delta, toks = self.text[self._sent_chars:end], range(self._sent_tokens, n)
        self._sent_chars, self._sent_tokens = end, n
        return delta, toks


def finish_choices(rows: list[ChoiceText], result: SampleResult) -> None:
    """The final reply: each row's tokens not seen yet (those of a dropped chunk too), and its end."""
    for row, tokens_T, logprobs_T, why in zip(rows, result.tokens, result.logprobs, result.stop_reasons):
        row.push(tokens_T[row.drawn:], logprobs_T[row.drawn:])
        row.end(why)

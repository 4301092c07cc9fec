"""Text out: tokens become the text a client is sent, while the answer is being made.

What it does: `IncrementalDecoder` turns token IDs into text pieces as they arrive, never emitting half a character,
in constant time per token; `HoldBack` holds back a tail that could be the start of a stop string; `TextOut` is the
two together, the one rule `stream` and the server both use (never half a character, never a stop string);
`cut_at_stop` is the same rule on a whole text; `naive_pieces` is what a careless streamer sends, for contrast.
What it does not do: decide when an answer stops (request.Stopper does) or send anything (the callers do).
"""
from __future__ import annotations


def cut_at_stop(text: str, stop_strings) -> str:
    """The text before the first stop string in it, or all of it. A stop string ends the answer and is never
    part of it, streamed or not (OpenAI's behaviour). Example: cut_at_stop("Paris. The", ["."]) -> "Paris"."""
    ends = [i for i in (text.find(s) for s in stop_strings) if i >= 0]
    return text[:min(ends)] if ends else text


class HoldBack:
    """Streams text without ever sending a stop string: a tail of the text that could be the start of one is held
    back until the next piece shows it is not; at a match, only the text before it goes out, then nothing.
    "".join(pushed pieces, flush()) == cut_at_stop(all the text). Without stop strings, pieces pass unchanged."""

    def __init__(self, stop_strings=()):
        self.stops = tuple(stop_strings)
        self.longest = max((len(x) for x in self.stops), default=0)
        self.text, self.sent, self.stopped = "", 0, False

    def push(self, piece: str) -> str:
        if self.stopped or not piece:
            return ""
        self.text += piece
        if not self.stops:
            return self._send(len(self.text))
        region = max(0, len(self.text) - len(piece) - self.longest + 1)  # a new match must end in the new piece
        cut = cut_at_stop(self.text[region:], self.stops)
        if len(cut) < len(self.text) - region:
            self.stopped = True
            return self._send(region + len(cut))
        held = max((k for x in self.stops for k in range(1, len(x)) if self.text.endswith(x[:k])), default=0)
        return self._send(len(self.text) - held)

    def flush(self) -> str:
        """The end: whatever was held back goes out, unless a stop string ended the text."""
        return "" if self.stopped else self._send(len(self.text))

    def _send(self, upto: int) -> str:
        out = self.text[self.sent:upto] if upto > self.sent else ""
        self.sent = max(self.sent, upto)
        return out


class TextOut:
    """The one text-out rule, for `stream` and the server alike: tokens in, text pieces out, never half a character
    (IncrementalDecoder) and never a stop string, not even its start (HoldBack). "".join(pieces, flush()) is the
    answer's text cut at its first stop string."""

    def __init__(self, tokenizer, stop_strings=()):
        self.decoder, self.hold = IncrementalDecoder(tokenizer), HoldBack(stop_strings)

    def push(self, token_id: int) -> str:
        return self.hold.push(self.decoder.push(token_id))

    def flush(self) -> str:
        return self.hold.push(self.decoder.flush()) + self.hold.flush()


class IncrementalDecoder:
    """Turns token IDs into text pieces as they arrive, never emitting half a character, in constant time
    per token. A byte-level tokenizer can split one character (an emoji, a CJK character, an accented
    letter) across tokens; decoding such a token alone gives U+FFFD. As production detokenizers do, we keep
    two offsets: we decode only a short window of recent tokens, hold text back while its tail is an
    incomplete character, and the pieces always join to exactly the full decoded text."""

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer, self.skip = tokenizer, skip_special_tokens
        self.ids: list[int] = []
        self.prefix = 0  # tokens before this one are fully emitted and never decoded again
        self.read = 0  # tokens before this one have had their text emitted
        self.text = ""  # everything emitted so far

    def _decode(self, ids) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip)

    def push(self, token_id: int) -> str:
        """Add one token; return the new complete text (possibly "")."""
        self.ids.append(int(token_id))
        done = self._decode(self.ids[self.prefix:self.read])
        window = self._decode(self.ids[self.prefix:])
        if window.endswith("\ufffd") or len(window) < len(done):  # subtle: the last character is still missing bytes
            return ""
        piece = window[len(done):]
        self.prefix, self.read = self.read, len(self.ids)
        self.text += piece
        return piece

    def flush(self) -> str:
        """Whatever is left at the end (an incomplete character is emitted as U+FFFD, like a full decode)."""
        done = self._decode(self.ids[self.prefix:self.read])
        piece = self._decode(self.ids[self.prefix:])[len(done):]
        self.prefix = self.read = len(self.ids)
        self.text += piece
        return piece


def naive_pieces(tokenizer, token_ids) -> list[str]:
    """Each token decoded on its own: what a careless streamer sends (broken characters included)."""
    return [tokenizer.decode([t], skip_special_tokens=True) for t in token_ids]

"""One request: its record, its result, its stop conditions, its checks and its detokenizer.

What it does: `Job` is the one record of a request in the engine (prompt, allowance, picker, drafter, tokens so
far, state, finish reason, timeline); `GenerationResult` and `Step` are what a caller gets back; `Stopper`
decides, token by token, whether a request is done and why (`STOP_REASONS`, mapped to OpenAI's finish_reason by
`FINISH_REASON`; `FAILURES` are a scheduler's or the engine's verdicts, reported as errors); `check_request` and
`check_stop_strings` refuse bad requests with a clear message; `IncrementalDecoder` turns tokens into text
pieces without ever emitting half a character. generation.py re-exports all of it (lessons import it there).
What it does not do: run a model or schedule anything (generation.py and batching.py do).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Callable

import torch

Pick = Callable[[torch.Tensor], "tuple[int, float]"]  # (V,) logits -> (token ID, its probability)

# The one stop vocabulary, and how each reason is reported to an OpenAI client.
STOP_REASONS = ("end_of_turn", "stop_string", "max_new_tokens", "context_window", "cancelled")
FINISH_REASON = {"end_of_turn": "stop", "stop_string": "stop", "max_new_tokens": "length",
                 "context_window": "length", "cancelled": "stop"}
# note: not stops. A scheduler's verdicts on a request that could not be served; a server reports them as
# errors (never as finish_reason "stop"), and FINISH_REASON has no entry for them on purpose.
FAILURES = ("rejected", "error")


@dataclass
class Step:
    """One generated token: which, with what probability, and when (seconds since the request began)."""
    index: int
    token_id: int
    text: str
    prob: float
    at: float


@dataclass
class GenerationResult:
    prompt_ids: list[int]
    token_ids: list[int]  # new tokens only, the stop token included if one fired
    text: str  # decoded new tokens, special tokens removed
    stop_reason: str  # one of STOP_REASONS
    steps: list[Step] = field(default_factory=list)

    def record(self, token: int, prob: float, tokenizer, at: float) -> Step:
        """Append one new token (the loop records every token through here, drafted or not)."""
        step = Step(len(self.token_ids), token, tokenizer.decode([token]), prob, at)
        self.token_ids.append(token)
        self.steps.append(step)
        return step

    def finish(self, reason: str, tokenizer, stop_strings=()) -> "GenerationResult":
        """Set the stop reason and the text; a stop string that ended it is not part of the text (OpenAI's way)."""
        text = tokenizer.decode(self.token_ids, skip_special_tokens=True)
        self.stop_reason, self.text = reason, cut_at_stop(text, stop_strings) if reason == "stop_string" else text
        return self

    @property
    def finish_reason(self) -> str:
        """The stop reason in OpenAI's words ("stop" or "length")."""
        return FINISH_REASON[self.stop_reason]

    @property
    def time_to_first_token(self) -> float:
        """Seconds from the request to the first new token (prefill plus one pick)."""
        return self.steps[0].at

    @property
    def inter_token_seconds(self) -> list[float]:
        """Gaps between consecutive new tokens (one decode step each)."""
        return [b.at - a.at for a, b in zip(self.steps, self.steps[1:])]


def end_of_turn_ids(model, tokenizer) -> set[int]:
    """Token IDs that end an answer: the generation config's eos_token_id(s) and the tokenizer's."""
    config = getattr(model, "generation_config", None)
    ids = getattr(config, "eos_token_id", None)
    ids = set(ids if isinstance(ids, (list, tuple)) else [ids] if ids is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


@dataclass
class SpecStats:
    """What speculative decoding did for one request (GenerationResult.speculative)."""
    verify_steps: int = 0
    drafted: int = 0
    accepted: int = 0
    accepted_at: list[int] = field(default_factory=list)  # indexes (in the answer) of tokens that were drafted

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_verify(self) -> float:
        return (self.accepted + self.verify_steps) / self.verify_steps if self.verify_steps else 0.0


def check_request(model, prompt_ids, max_new_tokens: int) -> list[int]:
    """Validate a one-prompt generation request; returns the prompt as a flat list of IDs.
    Accepts a list of ints, a (T,) tensor or a (1, T) tensor."""
    if isinstance(prompt_ids, (str, bytes)):
        raise TypeError("the prompt is text, not token IDs: tokenize it first, for example "
                        "context.context_ids(tokenizer, messages) or tokenizer(text)['input_ids']")
    if torch.is_tensor(prompt_ids):
        if prompt_ids.dim() == 2 and prompt_ids.shape[0] != 1:
            raise ValueError(f"got a batch of {prompt_ids.shape[0]} prompts: generate() takes one; "
                             "for several, use batching.generate_static or batching.run_schedule")
        if prompt_ids.dim() > 2 or prompt_ids.is_floating_point():
            raise ValueError(f"token IDs must be integers in a (T,) or (1, T) tensor, got {prompt_ids.dtype} "
                             f"of shape {tuple(prompt_ids.shape)}")
        ids = prompt_ids.flatten().tolist()
    else:
        if not isinstance(prompt_ids, Sequence) or any(isinstance(i, (list, tuple)) for i in prompt_ids):
            raise ValueError("the prompt must be a flat list of token IDs (for several prompts, see batching)")
        if any(isinstance(i, bool) or not isinstance(i, int) for i in prompt_ids):
            raise ValueError("every token ID must be an int")
        ids = list(prompt_ids)
    if not ids:
        raise ValueError("the prompt is empty: give at least one token to continue from")
    vocab = model.config.vocab_size
    bad = [i for i in ids if not 0 <= i < vocab]
    if bad:
        raise ValueError(f"token IDs {bad[:5]} are outside the vocabulary [0, {vocab}): "
                         "were they made by this model's tokenizer?")
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    window = model.config.max_position_embeddings
    if len(ids) >= window:
        raise ValueError(f"the prompt has {len(ids)} tokens but the context window holds {window}: "
                         "shorten it (lesson 02 shows strategies) to leave room for an answer")
    return ids


def check_stop_strings(stop_strings) -> tuple[str, ...]:
    """A sequence of non-empty strings. Example: ("\\n\\n", "END") -> ("\\n\\n", "END"); "END" is refused."""
    if isinstance(stop_strings, str):
        raise TypeError(f"stop_strings must be a list or tuple of strings, not one string: "
                        f"write stop_strings=[{stop_strings!r}] (a bare string would stop on each of its letters)")
    if stop_strings is None:
        return ()
    try:
        stops = tuple(stop_strings)
    except TypeError:
        raise TypeError(f"stop_strings must be a list or tuple of strings, got {stop_strings!r}") from None
    for s in stops:
        if not isinstance(s, str) or not s:
            raise ValueError(f"every stop string must be a non-empty string, got {s!r}")
    return stops


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


class Stopper:
    """Decides, token by token, whether one request is finished and why (the loop and the schedulers share it).
    Stop strings are looked for in the newly decoded tail only, so each token costs the same."""

    def __init__(self, tokenizer, stop_ids, max_new_tokens: int, room: int, stop_strings=()):
        self.stop_ids, self.max_new, self.room = frozenset(stop_ids), max_new_tokens, room
        self.stop_strings = check_stop_strings(stop_strings)
        self.longest = max((len(s) for s in self.stop_strings), default=0)
        self.decoder = IncrementalDecoder(tokenizer) if self.stop_strings else None
        self.count = 0

    def update(self, token: int) -> str | None:
        """Record one new token; return its stop reason, or None to go on."""
        self.count += 1
        if token in self.stop_ids:
            return "end_of_turn"
        if self.decoder is not None:
            piece = self.decoder.push(token)
            tail = self.decoder.text[-(self.longest + len(piece)):] if piece else ""
            if piece and any(s in tail for s in self.stop_strings):
                return "stop_string"
        if self.count >= self.room:
            return "context_window"
        if self.count >= self.max_new:
            return "max_new_tokens"
        return None


@dataclass
class Job:
    """One request in the engine: its prompt, how many tokens it may have, how to pick them, what it has made and
    when things happened. Every scheduler (Alone below, batching's) serves Jobs and records through `emit`."""
    name: str
    prompt: list[int]
    new_tokens: int
    stop_ids: frozenset = frozenset()  # tokens that end it early (end of turn); empty = run to new_tokens
    pick: Pick | None = None  # None = greedy
    stopper: Stopper | None = None  # None = made at admission from stop_ids and new_tokens (no stop strings)
    tokens: list[int] = field(default_factory=list)
    cancelled: bool = False  # set from outside (a client left); the job leaves at the next step
    finish_reason: str = ""  # one of STOP_REASONS once it is done (or one of FAILURES)
    start: float = float("nan")  # seconds since the run began: admitted to a batch
    first_token: float = float("nan")
    end: float = float("nan")
    draft: object = None  # a drafter (speculative.py): each step then verifies up to k drafted tokens
    k: int = 4
    cache_salt: str = ""  # a paged cache shares prefix blocks only between jobs of the same salt (lesson 13)

    def emit(self, token: int, stamp: float) -> str | None:
        """Record one generated token (every scheduler records through here); returns a stop reason or None."""
        self.tokens.append(token)
        if len(self.tokens) == 1:
            self.first_token = stamp
        return self.stopper.update(token)


def naive_pieces(tokenizer, token_ids) -> list[str]:
    """Each token decoded on its own: what a careless streamer sends (broken characters included)."""
    return [tokenizer.decode([t], skip_special_tokens=True) for t in token_ids]

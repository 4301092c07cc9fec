"""One request: its record, its result, its stop conditions, its checks and its detokenizer.

What it does: `Job` is the one record of a request in the engine (prompt, allowance, picker, drafter, tokens so
far, state, finish reason, timeline); `GenerationResult` and `NewToken` are what a caller gets back; `Stopper`
decides, token by token, whether a request is done and why (`STOP_REASONS`, mapped to OpenAI's finish_reason by
`FINISH_REASON`; `FAILURES` are a scheduler's or the engine's verdicts, reported as errors); `check_request` and
`check_stop_strings` refuse bad requests with a clear message.
What it does not do: run a model or schedule anything (the stages and the schedulers do), or turn tokens into the
text a client is sent (text_out.py does).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Callable

import torch

from .text_out import IncrementalDecoder, cut_at_stop

Pick = Callable[[torch.Tensor], "tuple[int, float]"]  # (V,) logits -> (token ID, its probability)

# The one stop vocabulary, and how each reason is reported to an OpenAI client.
STOP_REASONS = ("end_of_turn", "stop_string", "max_new_tokens", "context_window", "cancelled")
FINISH_REASON = {"end_of_turn": "stop", "stop_string": "stop", "max_new_tokens": "length",
                 "context_window": "length", "cancelled": "stop"}
# note: not stops. A scheduler's verdicts on a request that could not be served; a server reports them as
# errors (never as finish_reason "stop"), and FINISH_REASON has no entry for them on purpose.
FAILURES = ("rejected", "error")


@dataclass
class NewToken:
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
    steps: list[NewToken] = field(default_factory=list)

    def record(self, token: int, prob: float, tokenizer, at: float) -> NewToken:
        """Append one new token (the loop records every token through here, drafted or not)."""
        step = NewToken(len(self.token_ids), token, tokenizer.decode([token]), prob, at)
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
                             "for batching several, use generation.generate_static or generation.run_schedule")
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
    logprobs: int | None = None  # None: none kept; k >= 0: each token's log-probability and the k likeliest others
    logprob_trace: list = field(default_factory=list)  # per token: (logprob, [(token, logprob), ...] top k)
    fork_of: str = ""  # the name of a job with the same prompt: a paged scheduler forks its blocks (n > 1)

    def finish(self, reason: str, stamp: float) -> None:
        """The job is done (one of STOP_REASONS) or refused (one of FAILURES), at `stamp` seconds."""
        self.finish_reason, self.end = reason, stamp

    def default_stopper(self, window: int) -> None:
        """A job queued without a Stopper gets the plain one: its stop IDs, its allowance and what is left of the
        context window (no stop strings). Every batch scheduler calls this on admission."""
        if self.stopper is None:
            self.stopper = Stopper(None, self.stop_ids, self.new_tokens, window - len(self.prompt))

    def note_logprobs(self, logits: torch.Tensor, token: int) -> None:
        """Keep the chosen token's log-probability under the model's own distribution (log-softmax of the raw logits,
        before temperature, top-p or a grammar mask: what vLLM returns by default) and the `logprobs` likeliest
        tokens' (OpenAI's top_logprobs). Nothing when logprobs is None."""
        if self.logprobs is None:
            return
        logp = torch.log_softmax(logits.float(), dim=-1)  # (V,)
        top = torch.topk(logp, self.logprobs) if self.logprobs else None
        others = list(zip(top.indices.tolist(), top.values.tolist())) if top is not None else []
        self.logprob_trace.append((float(logp[token]), others))

    def emit(self, token: int, stamp: float) -> str | None:
        """Record one generated token (every scheduler records through here); returns a stop reason or None."""
        self.tokens.append(token)
        if len(self.tokens) == 1:
            self.first_token = stamp
        return self.stopper.update(token)

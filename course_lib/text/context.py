"""Context assembly: messages to the exact string and tokens the model reads, and what fits.

What it does: checks a chat (a list of {"role", "content"} messages), renders it with the model's
own chat template, splits the result into labelled segments (one per message, plus any default
system prompt the template adds and the generation prompt), counts tokens against a budget, and
fits an overlong conversation into a budget with one of three strategies: drop the oldest turns
(keeping the system prompt), cut the middle (keeping the first turn and the latest), or refuse.
What it does not do: summarise dropped turns or count tokens for a template other than the model's.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

ROLES = ("system", "user", "assistant")
STRATEGIES = ("drop_oldest", "truncate_middle", "refuse")
# phrases by which a reply admits that it cannot answer (lesson 02 searches replies for them; lower case)
NOT_KNOWING = ("don't know", "do not know", "not sure", "no way to know", "cannot know", "can't know",
               "haven't told", "have not told", "didn't tell", "did not tell", "don't have", "do not have",
               "not mentioned", "unable to", "i'm afraid")


def admits_not_knowing(reply: str) -> bool:
    """Whether a reply contains one of NOT_KNOWING's phrases: a plain search, not an understanding of the reply."""
    text = reply.lower().replace("’", "'")
    return any(phrase in text for phrase in NOT_KNOWING)


class ContextOverflowError(ValueError):
    """The conversation does not fit the token budget (and the strategy may not or cannot shorten it)."""


def validate_messages(messages) -> list[dict]:
    """Check a chat before it reaches the template; returns it unchanged, or raises with the index at fault."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict) or "role" not in msg or "content" not in msg:
            raise ValueError(f"message {i} must be a dict with 'role' and 'content', got {msg!r:.80}")
        if msg["role"] not in ROLES:
            raise ValueError(f"message {i} has unknown role {msg['role']!r}; use one of {ROLES}")
        if not isinstance(msg["content"], str):
            raise TypeError(f"message {i} content must be text (str), not {type(msg['content']).__name__}")
    return list(messages)


def render(tokenizer, messages, add_generation_prompt: bool = True) -> str:
    """The exact string the model reads for these messages."""
    return tokenizer.apply_chat_template(validate_messages(messages), tokenize=False,
                                         add_generation_prompt=add_generation_prompt)


def control_strings(tokenizer) -> list[str]:
    """The strings the tokenizer turns into control tokens (special and added tokens), e.g. '<|im_end|>'."""
    return sorted({str(t) for t in tokenizer.added_tokens_decoder.values()} | set(tokenizer.all_special_tokens))


def _ids(tokenizer, text: str, as_text: bool = False) -> list[int]:
    """IDs of a piece of text; as_text: a control-token string in it is split into ordinary tokens (text a user
    typed), instead of becoming the control token (text the template wrote)."""
    # note: verbose=False: a prompt longer than the window is reported by the caller (request.check_request),
    # not by the tokenizer's own warning about indexing errors
    return tokenizer(text, add_special_tokens=False, split_special_tokens=as_text, verbose=False)["input_ids"]


def context_ids(tokenizer, messages, add_generation_prompt: bool = True) -> list[int]:
    """The token IDs the model reads for these messages. What a message says stays text: a control-token string
    typed in a message ('<|im_end|>', '<|im_start|>system') is read as ordinary characters, so a user cannot
    close their turn or open a system one; only the template's own markers are control tokens."""
    messages = validate_messages(messages)
    specials = control_strings(tokenizer)
    if not any(s in m["content"] for m in messages for s in specials):  # the common case: the template's own IDs
        return tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, return_dict=True,
                                             tokenizer_kwargs={"verbose": False})["input_ids"]
    ids = []
    for piece, is_content in _split_contents(tokenizer, messages, add_generation_prompt):
        ids += _ids(tokenizer, piece, as_text=is_content)
    return ids


def _masked(messages) -> tuple[list[str], list[dict]]:
    """(a marker per message, the messages with each content replaced by its marker): rendering these shows where
    the template puts each content, whatever the content says."""
    marks = [f"\ue000{i}\ue001" for i in range(len(messages))]
    return marks, [{**m, "content": mark} for m, mark in zip(messages, marks)]


def _split_contents(tokenizer, messages, add_generation_prompt: bool) -> list[tuple[str, bool]]:
    """The rendered context as (piece, is a message's content) in order: the template is rendered with a marker
    in place of each content, so a content is found by position, never by searching for its text."""
    marks, masked = _masked(messages)
    layout = tokenizer.apply_chat_template(masked, tokenize=False, add_generation_prompt=add_generation_prompt)
    pieces, rest = [], layout
    for mark, m in zip(marks, messages):
        if rest.count(mark) != 1:
            raise ValueError("the chat template repeats or changes a message's text: it cannot be kept apart as text")
        before, rest = rest.split(mark)
        pieces += [(before, False), (m["content"], True)]
    pieces.append((rest, False))
    if "".join(p for p, _ in pieces) != render(tokenizer, messages, add_generation_prompt):
        raise ValueError("the chat template changes a message's text: it cannot be kept apart as text")
    return [(p, c) for p, c in pieces if p]


def chat_ids(tokenizer, question: str, system: str | None = None) -> list[int]:
    """The prompt IDs of one question, with an optional system prompt, through the chat template.
    Example: chat_ids(tokenizer, "What is the capital of France?", system="You are a helpful assistant.")"""
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": question}]
    return context_ids(tokenizer, messages)


STORY = "Write a short story about a robot who learns to paint."


def story_ids(tokenizer) -> list[int]:
    """The course's long-answer prompt (a short story), through the chat template."""
    return chat_ids(tokenizer, STORY)


EDIT = ("Fix the spelling and grammar of this paragraph and return it: The libary opens at nine in the morning on "
        "weekdays and at ten on Saturdays, and it is closed on Sundays and public holidays. Members can borow up to "
        "five books at a time and keep them for three weeks, and a loan can be renewed twice online unless another "
        "member has reserved the book.")


def edit_ids(tokenizer) -> list[int]:
    """The course's grounded-edit prompt (a paragraph to correct: the answer copies most of it), templated."""
    return chat_ids(tokenizer, EDIT)


HANDBOOK_QUESTIONS = ("How much does a student membership cost?", "When is the makerspace closed?",
                      "Can I cut PVC on the laser cutter?", "Who do I ask about the machines?",
                      "How long can a project stay on the project shelf?", "What do guests have to wear?")


def handbook_messages(question: str) -> list[dict]:
    """A question asked with a whole document as the system prompt (data/docs/makerspace_handbook.txt, about
    1,100 tokens): the course's long shared prefix, as chat messages (what a client would send)."""
    from pathlib import Path
    doc = (Path(__file__).resolve().parents[2] / "data" / "docs" / "makerspace_handbook.txt").read_text()
    return [{"role": "system", "content": "Answer the member's question from this handbook.\n\n" + doc},
            {"role": "user", "content": question}]


def handbook_ids(tokenizer, question: str) -> list[int]:
    """handbook_messages through the chat template. Example: handbook_ids(tokenizer, HANDBOOK_QUESTIONS[0])"""
    return context_ids(tokenizer, handbook_messages(question))


def filler_ids(tokenizer, n: int) -> list[int]:
    """n tokens of real text (a story sentence repeated), for length sweeps."""
    base = tokenizer(" Once upon a time, a small robot found a box of paints in an empty studio.",
                     add_special_tokens=False)["input_ids"]
    return (base * (n // len(base) + 1))[:n]


@dataclass(frozen=True)
class Segment:
    label: str  # "system", "user", "assistant", "default system prompt" or "generation prompt"
    text: str
    ids: list[int]


def segments(tokenizer, messages, add_generation_prompt: bool = True) -> list[Segment]:
    """The rendered context cut into labelled parts; their IDs concatenated equal context_ids() (a message that
    types a control-token string keeps it as text here too)."""
    messages = validate_messages(messages)
    guarded = any(s in m["content"] for m in messages for s in control_strings(tokenizer))
    marks, masked = _masked(messages)
    shown = masked if guarded else messages

    def unmask(text):
        for mark, m in zip(marks, messages):
            text = text.replace(mark, m["content"]) if guarded else text
        return text

    def ids_of(text):
        if not guarded:
            return _ids(tokenizer, text)
        ids = []
        for part in re.split("(\ue000\\d+\ue001)", text):
            if part in marks:
                ids += _ids(tokenizer, messages[marks.index(part)]["content"], as_text=True)
            elif part:
                ids += _ids(tokenizer, part)
        return ids

    out, done = [], ""
    prefixes = [(m["role"], shown[: i + 1], False) for i, m in enumerate(messages)]
    if add_generation_prompt:
        prefixes.append(("generation prompt", shown, True))
    for label, prefix, gen in prefixes:
        full = tokenizer.apply_chat_template(prefix, tokenize=False, add_generation_prompt=gen)
        assert full.startswith(done), "the chat template is not additive; segments cannot be split"
        piece = full[len(done):]
        if label != "system" and not done and piece.startswith("<|im_start|>system") and messages[0]["role"] != "system":
            # subtle: this template silently adds a default system prompt when none is given
            cut = piece.index("<|im_end|>") + len("<|im_end|>\n")
            out.append(Segment("default system prompt", piece[:cut], _ids(tokenizer, piece[:cut])))
            piece = piece[cut:]
        out.append(Segment(label, unmask(piece), ids_of(piece)))
        done = full
    return out


@dataclass(frozen=True)
class Budget:
    used: int
    budget: int
    parts: list[tuple[str, int]]  # (segment label, tokens), in context order

    @property
    def remaining(self) -> int:
        return self.budget - self.used

    @property
    def fits(self) -> bool:
        return self.used <= self.budget


def budget_report(tokenizer, messages, budget: int) -> Budget:
    """How many tokens each part uses and how many remain of a budget."""
    if not isinstance(budget, int) or isinstance(budget, bool) or budget < 1:
        raise ValueError(f"budget must be a positive number of tokens, got {budget!r}")
    segs = segments(tokenizer, messages)
    parts = [(s.label, len(s.ids)) for s in segs]
    return Budget(sum(n for _, n in parts), budget, parts)


@dataclass(frozen=True)
class Fit:
    strategy: str
    messages: list[dict]  # what the model will see
    dropped: list[int]  # indices into the original messages
    tokens: int


def fit_to_budget(tokenizer, messages, budget: int, strategy: str = "drop_oldest") -> Fit:
    """Shorten a conversation until its context (with generation prompt) fits `budget` tokens.
    The system prompt and the latest message are always kept; "refuse" raises instead of dropping."""
    messages = validate_messages(messages)
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; use one of {STRATEGIES}")
    if not isinstance(budget, int) or isinstance(budget, bool) or budget < 1:
        raise ValueError(f"budget must be a positive number of tokens, got {budget!r}")
    count = lambda keep: len(context_ids(tokenizer, [messages[i] for i in keep]))  # noqa: E731
    keep = list(range(len(messages)))
    has_system = messages[0]["role"] == "system"
    if has_system and count([0]) > budget:
        raise ContextOverflowError(f"the system prompt alone (with the generation prompt) takes {count([0])} tokens, more than the budget of {budget}")
    if count(keep) <= budget:
        return Fit(strategy, messages, [], count(keep))
    if strategy == "refuse":
        raise ContextOverflowError(f"the conversation needs {count(keep)} tokens but the budget is {budget}; "
                                   "shorten it or choose a strategy that drops turns")
    protected = {0} if has_system else set()
    protected.add(len(messages) - 1)
    if strategy == "truncate_middle":
        first = 1 if has_system else 0
        protected.update(i for i in (first, first + 1) if i < len(messages) - 1)
    droppable = [i for i in keep if i not in protected]
    while count(keep) > budget and droppable:
        i = droppable.pop(0)
        keep.remove(i)
        if droppable and droppable[0] == i + 1 and messages[i + 1]["role"] == "assistant":
            keep.remove(droppable.pop(0))  # drop the reply with its question: whole turns go
    if count(keep) > budget:
        raise ContextOverflowError(f"even the kept messages need {count(keep)} tokens, more than the budget of {budget}")
    return Fit(strategy, [messages[i] for i in keep], [i for i in range(len(messages)) if i not in keep], count(keep))

"""Checks for 02_context_assembly: count a context, measure template overhead, keep the most recent whole turns that
fit, and carry what was dropped into the system prompt."""
from __future__ import annotations

import json
from pathlib import Path

from ..text.context import ContextOverflowError, context_ids, fit_to_budget
from ..engine.generation import generate
from . import check_prediction, fresh, safely, verdict

CONVERSATION = Path(__file__).resolve().parents[2] / "data" / "conversation.json"
CHATS = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "S"}, {"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
     {"role": "user", "content": "c 👍"}],
]


# Conversations for the checks: the course's one, a fact in its first turn; two more with other facts, the same
# middle turns. The model's use of each fact was measured in stop 18 (lesson 02, exercise 4, prints it again).
FACT_TURNS = [("Hello! I'm Tom and I live in Lisbon.", "Hi Tom! Lisbon is a beautiful city.", "Which city do I live in?",
               "Lisbon"),
              ("Hi! My sister is called Clara.", "Clara is a lovely name.", "What is my sister's name?", "Clara")]
SENTENCES = ["Hi there.", "Can you help me plan a trip to the coast next month?", "Thanks, that is useful.",
             "Explain photosynthesis in two sentences.", "Sure: plants turn light, water and carbon dioxide into sugar "
             "and oxygen, in their leaves.", "What is 12 times 12?", "144.", "I like reading old detective novels.",
             "Tell me a fun fact about octopuses.", "An octopus has three hearts and blue blood.", "Ok!"]


def load_conversation() -> dict:
    return json.loads(CONVERSATION.read_text())


def check_count_context(count_context, tokenizer) -> bool:
    """count_context(messages) -> tokens the model reads, with the generation prompt."""
    for chat in CHATS:
        ok, got = safely(count_context, chat)
        if not ok:
            return verdict(False, "", got)
        want = len(context_ids(tokenizer, chat))
        if got != want:
            return verdict(False, "", f"for {chat} you returned {got!r}, the model reads {want} tokens. Hint: "
                           "apply_chat_template(..., add_generation_prompt=True, return_dict=True)['input_ids']")
    return verdict(True, "you count what the model reads, template and generation prompt included", "")


def check_overhead(answer, tokenizer) -> bool:
    """answer: tokens the template adds around the one-token message 'Hi' with system prompt 'Be brief.'
    (everything except the text tokens of 'Be brief.' and 'Hi'), generation prompt included."""
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    text = sum(len(tokenizer(m["content"], add_special_tokens=False)["input_ids"]) for m in chat)
    want = len(context_ids(tokenizer, chat)) - text
    return verdict(answer == want, f"{want} tokens of template for {text} tokens of text",
                   f"you said {answer!r}. Count the whole context, then subtract the tokens of the two texts")


def fact_conversations() -> list[tuple[list[dict], str]]:
    """(messages, fact) for the course's conversation and two more whose first turn holds another fact."""
    conv = load_conversation()
    out = [(conv["messages"], conv["fact"])]
    for user, assistant, question, fact in FACT_TURNS:
        messages = [dict(m) for m in conv["messages"]]
        messages[1:3] = [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
        messages[-1] = {"role": "user", "content": question}
        out.append((messages, fact))
    return out


def random_conversation(rng) -> list[dict]:
    """A system prompt, 2 to 7 whole turns (a user message and its reply), and a last user message."""
    messages = [{"role": "system", "content": rng.choice(["Be brief.", "You are a helpful assistant."])}]
    for _ in range(rng.randint(2, 7)):
        for role in ("user", "assistant"):
            messages.append({"role": role, "content": " ".join(rng.choice(SENTENCES) for _ in range(rng.randint(1, 4)))})
    messages.append({"role": "user", "content": rng.choice(SENTENCES)})
    return messages


def _kept_turns(messages, got, budget, tokenizer, name, fullest: bool = True) -> str | None:
    """What is wrong with `got` as the system message plus the most recent whole turns of `messages`, or None.
    fullest: also require that no further whole turn would fit (keep_recent; a rescue's carried text may take
    the room of a turn, so it is not asked)."""
    if not isinstance(got, list) or not got or got[-1] != messages[-1]:
        return f"budget {budget}: keep the last message last (the question being asked)"
    if not isinstance(got[0], dict) or got[0].get("role") != "system":
        return f"budget {budget}: keep the system message first"
    tail = got[1:]
    if tail != messages[len(messages) - len(tail):]:
        return f"budget {budget}: after the system message, keep a run of the MOST RECENT messages, unchanged"
    if tail[0]["role"] != "user":
        return (f"budget {budget}: what you kept opens with an {tail[0]['role']} message whose question was dropped: "
                "drop whole turns, a user message with the reply to it")
    if len(context_ids(tokenizer, got)) > budget:
        return f"budget {budget}: what you kept needs {len(context_ids(tokenizer, got))} tokens"
    start = len(messages) - len(tail)
    if fullest and start > 1 and len(context_ids(tokenizer, [got[0]] + messages[start - 2:])) <= budget:
        return f"budget {budget}: one more whole turn would still fit in {name}; keep as many as fit"
    return None


def check_keep_recent(keep_recent, tokenizer) -> bool:
    """keep_recent(messages, budget) -> the system message, then the most recent WHOLE turns that fit (a turn: a
    user message and the reply to it), then the last message. Checked on the course's conversation and on
    conversations drawn anew at each run, at budgets between the least that can fit and more than all."""
    rng = fresh()
    cases = [(load_conversation()["messages"], budget, "the course's conversation") for budget in (120, 200, 256, 1000)]
    for _ in range(4):
        messages = random_conversation(rng)
        low = len(context_ids(tokenizer, [messages[0], messages[-1]]))
        cases.append((messages, rng.randint(low, len(context_ids(tokenizer, messages)) + 20), "a random conversation"))
    for messages, budget, name in cases:
        ok, got = safely(keep_recent, [dict(m) for m in messages], budget)
        if not ok:
            return verdict(False, "", got)
        wrong = _kept_turns(messages, got, budget, tokenizer, name)
        if wrong:
            return verdict(False, "", wrong)
    return verdict(True, f"'drop the oldest', whole turns at a time, on {len(cases)} conversations and budgets", "")


def check_rescue(rescue, model, tokenizer, budget: int = 200) -> bool:
    """rescue(messages, budget) -> like keep_recent, but every dropped user message's text is carried into the system
    prompt (after its original text), so the model can still see what the user said. Graded on that, on random
    conversations; then the model answers the three fact questions with and without your rescue, and the check
    prints what it said: a 135M model uses a fact it can see only sometimes, and that is reported, not graded."""
    rng = fresh()
    cases = [(messages, budget) for messages, _ in fact_conversations()]
    for _ in range(3):
        messages = random_conversation(rng)
        everything = [{"role": "system", "content": messages[0]["content"] + " " + " ".join(
            m["content"] for m in messages[1:-1] if m["role"] == "user")}, messages[-1]]
        # room for every user message in the system prompt, a few words to introduce them, and a turn or two
        cases.append((messages, len(context_ids(tokenizer, everything)) + rng.randint(24, 80)))
    for messages, limit in cases:
        ok, got = safely(rescue, [dict(m) for m in messages], limit)
        if not ok:
            return verdict(False, "", got)
        if not isinstance(got, list) or not got or not isinstance(got[0], dict) or not str(
                got[0].get("content", "")).startswith(messages[0]["content"]):
            return verdict(False, "", f"budget {limit}: start with the system message, its original text first")
        carried = got[0]["content"][len(messages[0]["content"]):]
        wrong = _kept_turns(messages, got, limit, tokenizer, "", fullest=False)
        if wrong:
            return verdict(False, "", wrong)
        dropped = [m["content"] for m in messages[1:len(messages) - len(got) + 1] if m["role"] == "user"]
        lost = [text for text in dropped if text not in carried]
        if lost:
            return verdict(False, "", f"budget {limit}: the dropped user message {lost[0]!r} is not in the system prompt")
    print(f"{'fact':<9}{'whole conversation':<22}{'drop_oldest at ' + str(budget):<22}{'your rescue':<14}")
    for messages, fact in fact_conversations():
        replies = [generate(model, tokenizer, context_ids(tokenizer, m), max_new_tokens=30).text for m in
                   (messages, fit_to_budget(tokenizer, messages, budget, "drop_oldest").messages, rescue(messages, budget))]
        print(f"{fact:<9}" + "".join(f"{('uses it' if fact.lower() in r.lower() else 'misses it'):<22}" for r in replies[:2])
              + ("uses it" if fact.lower() in replies[2].lower() else "misses it") + f"   ({replies[2][:50]!r})")
    return verdict(True, "every dropped user message reaches the system prompt, and the context fits. Whether the "
                   "model used them is the table above: text it can see is necessary, not sufficient. Try wording "
                   "what you carry differently (in the third person, say) and rerun: the grade stays, the table "
                   "may change", "")


PREDICT_CHAT = [{"role": "system", "content": "You are a patient maths tutor."},
                {"role": "user", "content": "What is a prime number?"},
                {"role": "assistant", "content": "A whole number above 1 whose only divisors are 1 and itself."},
                {"role": "user", "content": "Is 51 prime?"},
                {"role": "assistant", "content": "No: 51 is 3 times 17."},
                {"role": "user", "content": "And 53?"}]


def text_tokens(tokenizer, messages=PREDICT_CHAT) -> list[int]:
    """Each message's text alone, in tokens (what the exercise shows before you predict)."""
    return [len(tokenizer(m["content"], add_special_tokens=False)["input_ids"]) for m in messages]


def check_context_prediction(prediction, tokenizer, messages=PREDICT_CHAT) -> bool:
    """prediction: your prediction, written BEFORE this runs, of the tokens the model reads for `messages`, with
    the generation prompt (the texts' own counts are printed first). The check renders the template and counts."""
    return check_prediction(prediction, lambda: len(context_ids(tokenizer, messages)), unit="tokens",
                            what=f"for these {len(messages)} messages", tolerance=1.1,
                            hint="Each message also costs its role markers; exercise 2 measured them for two "
                                 "messages, and the generation prompt comes once at the end")

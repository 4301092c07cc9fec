from course_lib.text.context import context_ids

model = tokenizer = None


def count_context(messages):
    return len(context_ids(tokenizer, messages))


def overhead():
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    text = sum(len(tokenizer(m["content"], add_special_tokens=False)["input_ids"]) for m in chat)
    return len(context_ids(tokenizer, chat)) - text


def keep_recent(messages, budget):
    system, history, last = messages[0], messages[1:-1], messages[-1]
    kept = [last]
    for start in range(len(history) - 2, -1, -2):  # whole turns, newest first: (user, assistant)
        trial = history[start:start + 2] + kept
        if len(context_ids(tokenizer, [system] + trial)) > budget:
            break
        kept = trial
    return [system] + kept


def rescue(messages, budget):
    """keep_recent with the dropped user messages written into the system prompt; dropping more to make room for
    them can drop more, so repeat until what is carried and what is dropped agree."""
    carried = []
    while True:
        note = " Earlier, the user said: " + " ".join(carried) if carried else ""
        system = {"role": "system", "content": messages[0]["content"] + note}
        kept = keep_recent([system] + messages[1:], budget)
        dropped = [m["content"] for m in messages[1:len(messages) - len(kept) + 1] if m["role"] == "user"]
        if dropped == carried:
            return kept
        carried = dropped


def context_prediction(messages):
    """The texts' tokens, plus each message's overhead measured on one message, plus the generation prompt."""
    two = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]  # exercise 2's chat
    bare = len(context_ids(tokenizer, two, add_generation_prompt=False))
    texts_two = sum(len(tokenizer(m["content"], add_special_tokens=False)["input_ids"]) for m in two)
    per_message = (bare - texts_two) / 2  # note: with a system message, so the template adds no default one
    generation_prompt = len(context_ids(tokenizer, two)) - bare
    texts = sum(len(tokenizer(m["content"], add_special_tokens=False)["input_ids"]) for m in messages)
    return texts + per_message * len(messages) + generation_prompt

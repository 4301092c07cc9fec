from course_lib.context import context_ids

model = tokenizer = None


def count_context(messages):
    return len(context_ids(tokenizer, messages))


def overhead():
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    text = sum(len(tokenizer(m["content"], add_special_tokens=False)["input_ids"]) for m in chat)
    return len(context_ids(tokenizer, chat)) - text


def keep_recent(messages, budget):
    kept = [messages[-1]]
    for message in reversed(messages[1:-1]):
        if len(context_ids(tokenizer, [messages[0], message] + kept)) > budget:
            break
        kept.insert(0, message)
    return [messages[0]] + kept


my_system_prompt = "You are a helpful assistant. Answer briefly. The user's dog is called Biscuit."

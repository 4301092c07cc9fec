"""Solutions for 14_speculative_decoding."""

model = tokenizer = None


def speedup(tokens_per_verify, step_ms, draft_ms, k, verify_ms):
    return tokens_per_verify * step_ms / (k * draft_ms + verify_ms)


def lookup(context, k, n=2):
    tail = context[-n:]
    for start in range(len(context) - n - 1, -1, -1):
        if context[start:start + n] == tail:
            return context[start + n:start + n + k]
    return []


def tokens_per_verify(a, k):
    return sum(a ** i for i in range(k + 1))


def verify_prediction(prompt_ids, k=4):
    """Halfway between prompt lookup's tokens per verify at k = 2 and k = 6 on the same prompt."""
    from course_lib.engine.generation import generate
    from course_lib.engine.speculative import PromptLookup
    runs = [generate(model, tokenizer, list(prompt_ids), 40, stop_ids=(), draft=PromptLookup(3), k=j).speculative
            for j in (2, 6)]
    return (runs[0].tokens_per_verify + runs[1].tokens_per_verify) / 2

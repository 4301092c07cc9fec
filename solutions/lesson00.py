import torch

from course_lib.engine.generation import generate

model = tokenizer = None  # set by the notebook (or the tests)


def count_tokens(text):
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def next_token(ids):
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([ids], device=model.device)).logits  # (1, T, V)
    return int(logits[0, -1].argmax())


def answer(question):
    ids = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                        return_dict=True)["input_ids"]
    return generate(model, tokenizer, ids, max_new_tokens=48).text


def loop_share_prediction(context_ids, n=100):
    """From an 8-token run: the first token's time is paid once, each further token costs one decode step."""
    generate(model, tokenizer, list(context_ids), max_new_tokens=2)  # warm-up: a first call pays extra
    r = generate(model, tokenizer, list(context_ids), max_new_tokens=8, stop_ids=())
    first, step = r.steps[0].at, (r.steps[-1].at - r.steps[0].at) / (len(r.steps) - 1)
    return (n - 1) * step / (first + (n - 1) * step)

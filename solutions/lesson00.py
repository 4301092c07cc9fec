import torch

from course_lib.generation import generate

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

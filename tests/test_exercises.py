"""Each exercise check accepts a right answer and rejects a wrong one."""
import torch

from course_lib.exercises import lesson00
from course_lib.generation import generate


def test_lesson00_count_tokens(tokenizer):
    assert lesson00.check_count_tokens(lambda t: len(tokenizer(t, add_special_tokens=False)["input_ids"]), tokenizer)
    assert not lesson00.check_count_tokens(lambda t: len(t.split()), tokenizer)


def test_lesson00_next_token(model, tokenizer):
    def right(ids):
        with torch.inference_mode():
            return int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax())

    def first_position(ids):
        with torch.inference_mode():
            return int(model(input_ids=torch.tensor([ids])).logits[0, 0].argmax())

    assert lesson00.check_next_token(right, model, tokenizer)
    assert not lesson00.check_next_token(first_position, model, tokenizer)


def test_lesson00_answer(model, tokenizer, capsys):
    def right(question):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                            return_dict=True)["input_ids"]
        return generate(model, tokenizer, ids, max_new_tokens=48).text

    def no_template(question):
        return generate(model, tokenizer, tokenizer(question)["input_ids"], max_new_tokens=48).text

    assert lesson00.check_answer(right, model, tokenizer)
    assert not lesson00.check_answer(no_template, model, tokenizer)
    assert not lesson00.check_answer(lambda q: (_ for _ in ()).throw(NotImplementedError), model, tokenizer)
    assert "NotImplementedError" in capsys.readouterr().out

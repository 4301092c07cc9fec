import torch

model = tokenizer = None


def greedy_loop(ids, n):
    ids = list(ids)
    for _ in range(n):
        with torch.inference_mode():
            logits = model(input_ids=torch.tensor([ids], device=model.device)).logits
        ids.append(int(logits[0, -1].argmax()))
    return ids[-n:]


def pieces_for(token_ids):
    pieces, emitted = [], ""
    for k in range(1, len(token_ids) + 1):
        text = tokenizer.decode(token_ids[:k])
        if text.endswith("\ufffd"):  # hold back an incomplete character
            pieces.append("")
        else:
            pieces.append(text[len(emitted):])
            emitted = text
    return pieces


def ttft_share(result):
    return result.steps[0].at / result.steps[-1].at


def arrival_prediction(prompt_ids, n=80):
    """TTFT + (n - 1) median gaps, from a shorter run of the same prompt."""
    from course_lib.engine.generation import generate
    run = generate(model, tokenizer, list(prompt_ids), max_new_tokens=30, stop_ids=())
    gaps = sorted(run.inter_token_seconds)
    return run.time_to_first_token + (n - 1) * gaps[len(gaps) // 2]

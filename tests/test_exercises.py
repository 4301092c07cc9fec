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


from collections import Counter

from course_lib.context import context_ids
from course_lib.exercises import lesson01, lesson02
from course_lib.tokenization import cl100k


def test_lesson01_count_both(tokenizer):
    right = lambda t: (len(tokenizer(t, add_special_tokens=False)["input_ids"]), len(cl100k().encode(t)))  # noqa: E731
    assert lesson01.check_count_both(right, tokenizer)
    assert not lesson01.check_count_both(lambda t: (len(t), len(t)), tokenizer)
    assert not lesson01.check_count_both(lambda t: right(t)[0], tokenizer)


def test_lesson01_space_word_accepts_and_rejects(tokenizer):
    candidates = ["capital", "station", "library", "window", "garden", "system", "people"]
    good = [w for w in candidates if len(tokenizer(" " + w, add_special_tokens=False)["input_ids"]) == 1
            and len(tokenizer(w, add_special_tokens=False)["input_ids"]) >= 2]
    assert good, "none of the candidate words has the property; pick others"
    assert lesson01.check_space_word(good[0], tokenizer)
    assert not lesson01.check_space_word("Paris", tokenizer)  # one token both ways
    assert not lesson01.check_space_word("cat", tokenizer)  # too short
    assert not lesson01.check_space_word("two words", tokenizer)


def test_lesson01_first_merge():
    def right(text):
        data = text.encode("utf-8")
        return Counter(zip(data, data[1:])).most_common(1)[0][0]

    assert lesson01.check_first_merge(right)
    assert not lesson01.check_first_merge(lambda text: tuple(text[:2].encode()))


def test_lesson01_cost(tokenizer):
    assert lesson01.check_cost(lambda t, p: len(tokenizer(t, add_special_tokens=False)["input_ids"]) * p / 1e6, tokenizer)
    assert not lesson01.check_cost(lambda t, p: len(t.split()) * p / 1e6, tokenizer)


def test_lesson02_count_context(tokenizer):
    assert lesson02.check_count_context(lambda m: len(context_ids(tokenizer, m)), tokenizer)
    assert not lesson02.check_count_context(lambda m: len(context_ids(tokenizer, m, add_generation_prompt=False)),
                                            tokenizer)


def test_lesson02_overhead(tokenizer):
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    text = sum(len(tokenizer(m["content"], add_special_tokens=False)["input_ids"]) for m in chat)
    assert lesson02.check_overhead(len(context_ids(tokenizer, chat)) - text, tokenizer)
    assert not lesson02.check_overhead(len(context_ids(tokenizer, chat)), tokenizer)
    assert not lesson02.check_overhead(None, tokenizer)


def test_lesson02_keep_recent(tokenizer):
    def right(messages, budget):
        kept = [messages[-1]]
        for msg in reversed(messages[1:-1]):
            if len(context_ids(tokenizer, [messages[0], msg] + kept)) > budget:
                break
            kept.insert(0, msg)
        return [messages[0]] + kept

    assert lesson02.check_keep_recent(right, tokenizer)
    assert not lesson02.check_keep_recent(lambda m, b: [m[0], m[-1]], tokenizer)  # not maximal
    assert not lesson02.check_keep_recent(lambda m, b: m, tokenizer)  # over budget


def test_lesson02_rescue(model, tokenizer):
    assert lesson02.check_rescue("You are a helpful assistant. Answer briefly. The user's dog is called Biscuit.",
                                 model, tokenizer)
    assert not lesson02.check_rescue("You are a helpful assistant. Answer briefly.", model, tokenizer)
    assert not lesson02.check_rescue("", model, tokenizer)


from course_lib.exercises import lesson05, lesson06
from course_lib.forward import forward_logits
from course_lib.generation import GenerationResult
from course_lib.sampling import logits_to_probs as sampling_probs
from course_lib.sampling import sample

from conftest import chat_ids


def _logits(model, tokenizer):
    return forward_logits(model, chat_ids(tokenizer, "What is the capital of France?"))[0, -1]


def test_lesson05_temperature(model, tokenizer):
    logits = _logits(model, tokenizer)
    assert lesson05.check_temperature_probs(lambda v, t: torch.softmax(v / t, dim=-1), logits)
    assert not lesson05.check_temperature_probs(lambda v, t: torch.softmax(v * t, dim=-1), logits)


def test_lesson05_top_k(model, tokenizer):
    logits = _logits(model, tokenizer)

    def right(v, k):
        return v.masked_fill(v < torch.topk(v, k).values[-1], float("-inf"))

    assert lesson05.check_top_k(right, logits)
    assert not lesson05.check_top_k(lambda v, k: v.masked_fill(v <= torch.topk(v, k).values[-1], float("-inf")), logits)


def test_lesson05_estimate(model, tokenizer):
    logits = _logits(model, tokenizer)
    the_id = tokenizer.encode("The", add_special_tokens=False)[0]
    draws = sample(sampling_probs(logits), torch.Generator().manual_seed(3), 5000)
    assert lesson05.check_estimate(float((draws == the_id).float().mean()), the_id, logits)
    assert not lesson05.check_estimate(0.5, the_id, logits)
    assert not lesson05.check_estimate("high", the_id, logits)


def test_lesson06_greedy_loop(model, tokenizer):
    ids = chat_ids(tokenizer, "What is the capital of France?")

    def right(ids, n):
        ids = list(ids)
        for _ in range(n):
            with torch.inference_mode():
                ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
        return ids[-n:]

    assert lesson06.check_greedy_loop(right, model, tokenizer, ids)
    assert not lesson06.check_greedy_loop(lambda ids, n: right(ids, n)[:-1] + [0], model, tokenizer, ids)


def test_lesson06_streamer(tokenizer):
    def right(ids):
        out, emitted = [], ""
        for k in range(1, len(ids) + 1):
            text = tokenizer.decode(ids[:k])
            if not text.endswith("\ufffd"):
                out.append(text[len(emitted):])
                emitted = text
        return out

    assert lesson06.check_streamer(right, tokenizer)
    assert not lesson06.check_streamer(lambda ids: [tokenizer.decode([t]) for t in ids], tokenizer)


def test_lesson06_ttft_share(model, tokenizer):
    ids = chat_ids(tokenizer, "What is the capital of France?")
    assert lesson06.check_ttft_share(lambda r: r.steps[0].at / r.steps[-1].at, model, tokenizer, ids)
    assert not lesson06.check_ttft_share(lambda r: r.steps[0].at, model, tokenizer, ids)
    assert isinstance(GenerationResult([1], [], "", "max_new_tokens"), GenerationResult)


from course_lib.exercises import lesson03, lesson04


def test_lesson03_checks(model, tokenizer):
    assert lesson03.check_count_params(lambda m: sum(p.numel() for p in m.parameters()), model)
    assert not lesson03.check_count_params(lambda m: len(list(m.parameters())), model)

    def entropy(p):
        p = p[p > 0]
        return float(-(p * p.log2()).sum())

    assert lesson03.check_entropy(entropy)
    assert not lesson03.check_entropy(lambda p: float(-(p * p.clamp_min(1e-12).log()).sum()))  # nats, not bits
    assert lesson03.check_first_layer(29, model, tokenizer)
    assert not lesson03.check_first_layer(10, model, tokenizer)
    assert lesson03.check_project(lambda h: int(model.lm_head(model.model.norm(h)).argmax()), model, tokenizer)
    assert not lesson03.check_project(lambda h: int(model.lm_head(h).argmax()), model, tokenizer)


def test_lesson04_checks(model, tokenizer):
    import math
    assert lesson04.check_causal_mask(lambda T: torch.triu(torch.ones(T, T, dtype=torch.bool), 1))
    assert not lesson04.check_causal_mask(lambda T: torch.tril(torch.ones(T, T, dtype=torch.bool), -1))

    def head(q, k):
        T, D = q.shape
        s = (q @ k.T / math.sqrt(D)).masked_fill(torch.triu(torch.ones(T, T, dtype=torch.bool), 1), float("-inf"))
        return torch.softmax(s, dim=-1)

    assert lesson04.check_head_by_hand(head)
    assert not lesson04.check_head_by_hand(lambda q, k: torch.softmax(q @ k.T, dim=-1))
    assert lesson04.check_kv_head(lambda h: h // 3, model.config)
    assert not lesson04.check_kv_head(lambda h: h % 3, model.config)


def test_lesson04_strongest_head(tokenizer):
    import course_lib
    eager, _ = course_lib.load_model(device="cpu", attn_implementation="eager", verbose=False)
    text = "The bank is closed because they had no money left."
    assert lesson04.check_strongest_head((13, 8), eager, tokenizer, text, " they", " bank")
    assert not lesson04.check_strongest_head((0, 0), eager, tokenizer, text, " they", " bank")
    assert not lesson04.check_strongest_head(None, eager, tokenizer, text, " they", " bank")


from course_lib.bench import decode_seconds, prefill_seconds, story_ids
from course_lib.exercises import lesson07, lesson08
from course_lib.kv_cache import run_with_cache, run_without_cache


def test_lesson07_checks(model, tokenizer):
    assert lesson07.check_kv_bytes(lambda t, l, kv, d, b: 2 * t * l * kv * d * b, model)
    assert not lesson07.check_kv_bytes(lambda t, l, kv, d, b: t * l * kv * d * b, model)
    assert lesson07.check_positions(lambda p, n: sum(p + i for i in range(n)))
    assert not lesson07.check_positions(lambda p, n: p * n)


def test_lesson07_ratio(model, tokenizer):
    prompt = story_ids(tokenizer)
    measured = run_without_cache(model, prompt, 48).total / run_with_cache(model, prompt, 48).total
    assert lesson07.check_ratio(measured, model, prompt)
    assert not lesson07.check_ratio(measured * 10, model, prompt)
    assert not lesson07.check_ratio(None, model, prompt)


def test_lesson08_checks(model, tokenizer):
    assert lesson08.check_bandwidth(lambda b, s: b / s)
    assert not lesson08.check_bandwidth(lambda b, s: b * s)
    assert lesson08.check_crossover(lambda w, k: int(w // k))
    assert not lesson08.check_crossover(lambda w, k: w / k)
    ratio = (256 / prefill_seconds(model, tokenizer, [256])[0]) * decode_seconds(model, tokenizer, [256])[0]
    assert lesson08.check_phase_ratio(ratio, model, tokenizer)
    assert not lesson08.check_phase_ratio(ratio / 20, model, tokenizer)


from course_lib.exercises import lesson09, lesson10


def test_lesson09_checks():
    def right(seqs, pad):
        T = max(len(s) for s in seqs)
        ids = torch.tensor([[pad] * (T - len(s)) + s for s in seqs])
        mask = torch.tensor([[0] * (T - len(s)) + [1] * len(s) for s in seqs])
        return ids, mask

    def right_pad(seqs, pad):
        T = max(len(s) for s in seqs)
        return (torch.tensor([s + [pad] * (T - len(s)) for s in seqs]),
                torch.tensor([[1] * len(s) + [0] * (T - len(s)) for s in seqs]))

    assert lesson09.check_left_pad(right)
    assert not lesson09.check_left_pad(right_pad)
    assert lesson09.check_waste(lambda ls: sum(max(ls) - n for n in ls) / (max(ls) * len(ls)))
    assert not lesson09.check_waste(lambda ls: sum(max(ls) - n for n in ls))
    assert lesson09.check_mean_latency(lambda jobs: sum(j.end for j in jobs) / len(jobs))
    assert not lesson09.check_mean_latency(lambda jobs: max(j.end for j in jobs))


def test_lesson10_checks():
    import json as _json
    assert lesson10.check_body(lambda q: {"messages": [{"role": "user", "content": q}], "stream": True, "max_tokens": 50})
    assert not lesson10.check_body(lambda q: {"messages": [{"role": "user", "content": q}], "max_tokens": 50})

    def parse(raw):
        out = ""
        for line in raw.splitlines():
            if line.startswith("data: ") and line != "data: [DONE]":
                out += _json.loads(line[6:])["choices"][0]["delta"].get("content", "")
        return out

    assert lesson10.check_parse(parse)
    assert not lesson10.check_parse(lambda raw: raw)
    assert lesson10.check_ttft(lambda start, arrivals: min(arrivals) - start)
    assert not lesson10.check_ttft(lambda start, arrivals: max(arrivals) - start)

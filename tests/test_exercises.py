"""Every exercise check accepts the solution in solutions/ and rejects typical wrong answers."""
import importlib
import math

import pytest
import torch

import course_lib
from course_lib.text.context import story_ids
from course_lib.exercises import (lesson00, lesson01, lesson02, lesson03, lesson04, lesson05, lesson06, lesson07,
                                  lesson08, lesson09, lesson10, lesson11)
from course_lib.runner.forward import forward_logits
from course_lib.engine.generation import generate

from conftest import chat_ids


def solution(n, model, tokenizer):
    module = importlib.import_module(f"solutions.lesson{n:02d}")
    module.model, module.tokenizer = model, tokenizer
    return module


@pytest.fixture(scope="module")
def eager():
    return course_lib.load_model(device="cpu", attn_implementation="eager", verbose=False)


@pytest.fixture(scope="module")
def capital_logits(model, tokenizer):
    return forward_logits(model, chat_ids(tokenizer, "What is the capital of France?"))[0, -1]


def test_lesson00(model, tokenizer):
    s = solution(0, model, tokenizer)
    assert lesson00.check_count_tokens(s.count_tokens, tokenizer)
    assert lesson00.check_next_token(s.next_token, model, tokenizer)
    assert lesson00.check_answer(s.answer, model, tokenizer)
    assert not lesson00.check_count_tokens(lambda t: len(t.split()), tokenizer)
    first = lambda ids: int(model(input_ids=torch.tensor([ids])).logits[0, 0].argmax())  # noqa: E731
    assert not lesson00.check_next_token(first, model, tokenizer)
    raw = lambda q: generate(model, tokenizer, tokenizer(q)["input_ids"], max_new_tokens=48).text  # noqa: E731
    assert not lesson00.check_answer(raw, model, tokenizer)


def test_lesson00_unfinished_exercise_gives_a_hint(model, tokenizer, capsys):
    def unfinished(question):
        raise NotImplementedError

    assert not lesson00.check_answer(unfinished, model, tokenizer)
    assert "NotImplementedError" in capsys.readouterr().out


def test_lesson01(model, tokenizer):
    s = solution(1, model, tokenizer)
    assert lesson01.check_count_both(s.count_both, tokenizer)
    assert lesson01.check_space_word(s.word(), tokenizer)
    assert lesson01.check_first_merge(s.first_merge)
    assert lesson01.check_cost(s.cost_of, tokenizer)
    assert not lesson01.check_count_both(lambda t: (len(t), len(t)), tokenizer)
    assert not lesson01.check_count_both(lambda t: s.count_both(t)[0], tokenizer)
    for wrong in ["Paris", "cat", "two words", 42]:
        assert not lesson01.check_space_word(wrong, tokenizer)
    assert not lesson01.check_first_merge(lambda text: tuple(text[:2].encode()))
    assert not lesson01.check_cost(lambda q, a, pi, po: (len(q.split()) * pi + len(a.split()) * po) / 1e6, tokenizer)
    assert not lesson01.check_cost(lambda q, a, pi, po: s.cost_of(q + a, "", pi, pi), tokenizer)  # one price for all
    assert not lesson01.check_cost(lambda q, a, pi, po: s.cost_of(q, a, pi, po) * 1e6, tokenizer)  # not per million


def test_lesson02(model, tokenizer):
    s = solution(2, model, tokenizer)
    assert lesson02.check_count_context(s.count_context, tokenizer)
    assert lesson02.check_overhead(s.overhead(), tokenizer)
    assert lesson02.check_keep_recent(s.keep_recent, tokenizer)
    assert lesson02.check_rescue(s.rescue, model, tokenizer)
    from course_lib.text.context import context_ids
    assert not lesson02.check_count_context(lambda m: len(context_ids(tokenizer, m, add_generation_prompt=False)),
                                            tokenizer)
    assert not lesson02.check_overhead(s.overhead() + 2, tokenizer) and not lesson02.check_overhead(None, tokenizer)
    assert not lesson02.check_keep_recent(lambda m, b: [m[0], m[-1]], tokenizer)  # fits, but not as many as fit
    assert not lesson02.check_keep_recent(lambda m, b: m, tokenizer)  # over the budget

    def one_message_at_a_time(messages, budget):  # the old exercise's answer: can open with an orphan reply
        kept = [messages[-1]]
        for message in reversed(messages[1:-1]):
            if len(context_ids(tokenizer, [messages[0], message] + kept)) > budget:
                break
            kept.insert(0, message)
        return [messages[0]] + kept

    assert not any(lesson02.check_keep_recent(one_message_at_a_time, tokenizer) for _ in range(3))
    assert not lesson02.check_rescue(s.keep_recent, model, tokenizer)  # drops, carries nothing

    def hard_coded(messages, budget):  # the old exercise's answer: the first conversation's fact, typed in
        kept = s.keep_recent(messages, budget - 12)
        return [{"role": "system", "content": kept[0]["content"] + " The user's dog is called Biscuit."}] + kept[1:]

    assert not lesson02.check_rescue(hard_coded, model, tokenizer)
    assert not lesson02.check_rescue(lambda m, b: s.rescue(m, 10_000), model, tokenizer)  # over the budget


def test_lesson03(model, tokenizer):
    s = solution(3, model, tokenizer)
    assert lesson03.check_count_params(s.count_params, model)
    assert lesson03.check_entropy(s.entropy_bits)
    for text, word in lesson03.LENS_TASKS:
        assert lesson03.check_first_layer(s.first_layer(text, word), model, tokenizer, text, word)
    task = lesson03.first_layer_task(model, tokenizer)
    assert set(task) == {"text", "word"} and (task["text"], task["word"]) in lesson03.LENS_TASKS
    assert lesson03.check_project(s.project, model, tokenizer)
    assert not lesson03.check_count_params(lambda m: len(list(m.parameters())), model)
    assert not lesson03.check_entropy(lambda p: float(-(p * p.clamp_min(1e-12).log()).sum()))  # nats, not bits
    answers = {lesson03._first_hit(model, tokenizer, t, w) for t, w in lesson03.LENS_TASKS}
    assert len(answers) >= 3  # no constant passes every task
    for constant in range(30):  # a constant (the lesson's own example printed 29) fails some task
        assert not all(lesson03.check_first_layer(constant, model, tokenizer, t, w) for t, w in lesson03.LENS_TASKS)
    assert not lesson03.check_project(lambda h: int(model.lm_head(h).argmax()), model, tokenizer)  # no final norm


def test_lesson04(eager, tokenizer):
    s = solution(4, eager.model, tokenizer)
    assert lesson04.check_causal_mask(s.causal_mask)
    assert lesson04.check_head_by_hand(s.head_weights)
    assert lesson04.check_kv_head(s.kv_head_of, eager.model.config)
    for text, query, key in lesson04.HEAD_TASKS:
        assert lesson04.check_strongest_head(s.strongest(text, query, key), eager.model, tokenizer, text, query, key)
    lesson_answer = s.strongest("The bank is closed because they had no money left.", " they", " bank")
    assert not all(lesson04.check_strongest_head(lesson_answer, eager.model, tokenizer, *t) for t in lesson04.HEAD_TASKS)
    assert not lesson04.check_causal_mask(lambda T: torch.tril(torch.ones(T, T, dtype=torch.bool), -1))
    assert not lesson04.check_head_by_hand(lambda q, k: torch.softmax(q @ k.T, dim=-1))
    assert not lesson04.check_kv_head(lambda h: h % 3, eager.model.config)
    assert not lesson04.check_strongest_head((0, 0), eager.model, tokenizer, *lesson04.HEAD_TASKS[0])
    assert not lesson04.check_strongest_head(None, eager.model, tokenizer, *lesson04.HEAD_TASKS[0])


def test_lesson04_probes(model, tokenizer):
    from course_lib.inside import probes
    s = solution(4, model, tokenizer)
    clean = probes.answer_ids(tokenizer, "What is the capital of France?", "The capital of France is")
    corrupt = probes.answer_ids(tokenizer, "What is the capital of Germany?", "The capital of Germany is")
    good, bad = probes.token_id(tokenizer, " Paris"), probes.token_id(tokenizer, " Berlin")
    assert lesson04.check_patch_prediction(s.patch_prediction, model, clean, corrupt, good, bad)
    assert not lesson04.check_patch_prediction(0.5, model, clean, corrupt, good, bad)
    assert not lesson04.check_patch_prediction(None, model, clean, corrupt, good, bad)
    effects = torch.zeros(30, 9)
    effects[23, 4], effects[5, 1] = -4.0, 2.0
    assert lesson04.check_most_important_head(s.most_important_head(effects), effects)
    assert not lesson04.check_most_important_head((5, 1), effects)  # the largest effect, not the most negative
    reference = [probes.answer_ids(tokenizer, f"What is the capital of {c}?", f"The capital of {c} is")
                 for c in ["Italy", "Spain", "Japan", "Egypt", "Canada", "Brazil"]]
    means = probes.mean_head_outputs(model, reference)
    assert lesson04.check_layer_effect(s.layer_effect, model, clean, good, bad, means)
    one_head = lambda layer: probes.ablated_metric(model, clean, good, bad, [(layer, 0)], means) - \
        probes.ablated_metric(model, clean, good, bad, [])  # noqa: E731 - one head, not the layer
    assert not lesson04.check_layer_effect(one_head, model, clean, good, bad, means)


def test_lesson05(model, tokenizer, capital_logits):
    s = solution(5, model, tokenizer)
    the_id = tokenizer.encode("The", add_special_tokens=False)[0]
    assert lesson05.check_temperature_probs(s.temperature_probs, capital_logits)
    assert lesson05.check_top_k(s.my_top_k, capital_logits)
    assert lesson05.check_estimate(s.draws(capital_logits), the_id, capital_logits)
    assert not lesson05.check_temperature_probs(lambda v, t: torch.softmax(v * t, dim=-1), capital_logits)
    assert not lesson05.check_top_k(lambda v, k: v.masked_fill(v <= torch.topk(v, k).values[-1], -math.inf),
                                    capital_logits)
    assert not lesson05.check_estimate(0.5, the_id, capital_logits)
    assert not lesson05.check_estimate("high", the_id, capital_logits)
    exact = float(torch.softmax(capital_logits.float(), -1)[the_id])
    assert not lesson05.check_estimate(exact, the_id, capital_logits)  # the exact probability is not a simulation
    made_up = [the_id] * round(exact * 5000) + [0] * (5000 - round(exact * 5000))  # the right share, nothing else
    assert not lesson05.check_estimate(made_up, the_id, capital_logits)
    hot = torch.multinomial(torch.softmax(capital_logits.float() / 2, -1), 5000, replacement=True).tolist()
    assert not lesson05.check_estimate(hot, the_id, capital_logits)  # sampled, at temperature 2


def test_lesson06(model, tokenizer):
    s = solution(6, model, tokenizer)
    ids = chat_ids(tokenizer, "What is the capital of France?")
    assert lesson06.check_greedy_loop(s.greedy_loop, model, tokenizer, ids)
    assert lesson06.check_streamer(s.pieces_for, tokenizer)
    assert lesson06.check_ttft_share(s.ttft_share, model, tokenizer, ids)
    assert not lesson06.check_greedy_loop(lambda ids, n: s.greedy_loop(ids, n)[:-1] + [0], model, tokenizer, ids)
    assert not lesson06.check_streamer(lambda ids: [tokenizer.decode([t]) for t in ids], tokenizer)
    assert not lesson06.check_ttft_share(lambda r: r.steps[0].at, model, tokenizer, ids)


def test_lesson07(model, tokenizer):
    s = solution(7, model, tokenizer)
    prompt = story_ids(tokenizer)
    assert lesson07.check_kv_bytes(s.kv_bytes, model)
    assert lesson07.check_positions(s.positions_without_cache)
    measured = s.ratio(prompt)
    assert measured > 1  # the cache is faster, under any load
    # note: the reference is the solution's own measurement, so a busy machine cannot make this flaky
    assert lesson07.check_ratio(measured, model, tokenizer, prompt, reference=measured * 1.3)
    assert not lesson07.check_kv_bytes(lambda t, l, kv, d, b: t * l * kv * d * b, model)  # forgot keys AND values
    assert not lesson07.check_positions(lambda p, n: p * n)
    assert not lesson07.check_ratio(measured * 10, model, tokenizer, prompt, reference=measured)
    assert not lesson07.check_ratio(None, model, tokenizer, prompt)


def test_lesson08(model, tokenizer):
    s = solution(8, model, tokenizer)
    assert lesson08.check_bandwidth(s.achieved_bandwidth)
    assert lesson08.check_crossover(s.crossover_context)
    measured = s.ratio()
    assert measured > 1  # prefill processes tokens faster than decode, under any load
    assert lesson08.check_phase_ratio(measured, model, tokenizer, reference=measured / 1.5)
    assert not lesson08.check_bandwidth(lambda b, t: b * t)
    assert not lesson08.check_crossover(lambda w, k, b: w / k)
    assert not lesson08.check_crossover(lambda w, k, b: int(w // k))  # the batch forgotten
    assert not lesson08.check_crossover(lambda w, k, b: int(w * b // k))  # the weights read once per row
    assert not lesson08.check_phase_ratio(measured / 20, model, tokenizer, reference=measured)
    assert lesson08.check_ttft_prediction(s.ttft_prediction(), model, tokenizer)
    assert not lesson08.check_ttft_prediction(0.05, model, tokenizer)  # a decode step's time, not a prefill's
    assert not lesson08.check_ttft_prediction(None, model, tokenizer)


def test_lesson09(model, tokenizer):
    s = solution(9, model, tokenizer)
    assert lesson09.check_left_pad(s.my_left_pad)
    assert lesson09.check_waste(s.waste_fraction)
    assert lesson09.check_mean_latency(s.mean_latency)

    def right_padded(seqs, pad):
        T = max(len(x) for x in seqs)
        return (torch.tensor([x + [pad] * (T - len(x)) for x in seqs]),
                torch.tensor([[1] * len(x) + [0] * (T - len(x)) for x in seqs]))

    assert not lesson09.check_left_pad(right_padded)
    assert not lesson09.check_waste(lambda ls: sum(max(ls) - n for n in ls))
    assert not lesson09.check_mean_latency(lambda jobs: max(j.end for j in jobs))


def test_lesson10(model, tokenizer):
    s = solution(10, model, tokenizer)
    assert lesson10.check_body(s.make_body)
    assert lesson10.check_parse(s.parse_stream)
    assert lesson10.check_ttft(s.ttft)
    assert not lesson10.check_body(lambda q: {"messages": [{"role": "user", "content": q}], "max_tokens": 50})
    assert not lesson10.check_parse(lambda raw: raw)
    assert not lesson10.check_ttft(lambda start, arrivals: max(arrivals) - start)


def test_lesson11(model, tokenizer):
    from course_lib.runner.model import Model
    ours = Model.from_transformers(model)
    s = solution(11, model, tokenizer)
    assert lesson11.check_rms_norm(s.rms_norm, ours)
    assert lesson11.check_rotate(s.rotate, ours)
    assert lesson11.check_cache_bytes(s.cache_bytes, ours)
    assert not lesson11.check_rms_norm(lambda x, w, e: w * (x - x.mean(-1, keepdim=True)) / x.std(-1, keepdim=True), ours)
    assert not lesson11.check_rotate(lambda x, p: x, ours)  # right only at position 0
    assert not lesson11.check_cache_bytes(lambda b, t: s.cache_bytes(b, t) // 2, ours)  # forgot the values


def test_lesson12():
    from course_lib.exercises import lesson12
    s = solution(12, None, None)
    assert lesson12.check_predict(s.predict, 1e8, 1e10, 50.0)
    assert lesson12.check_int8(s.quantize)
    assert lesson12.check_block(s.block_params)
    assert not lesson12.check_predict(lambda b, bw: b / bw, 1e8, 1e10, 50.0)
    assert not lesson12.check_int8(lambda w: (torch.round(w / (w.abs().max() / 127)).to(torch.int8),
                                              (w.abs().max() / 127).repeat(w.shape[0]) * 0 + 1))  # scale wrong
    assert not lesson12.check_block(lambda w: ((w.max() - w.min()) / 16, w.min()))  # 16 steps instead of 15


def test_lesson13():
    from course_lib.exercises import lesson13
    s = solution(13, None, None)
    assert lesson13.check_blocks_needed(s.blocks_needed)
    assert lesson13.check_shared_blocks(s.shared_blocks)
    assert lesson13.check_ttft_prediction(s.predict_ttft)
    assert not lesson13.check_blocks_needed(lambda p, n, b=16: (p + n) // b)  # the partial block forgotten
    assert not lesson13.check_shared_blocks(lambda prompts, b: sum(-(-len(p) // b) for p in prompts))  # no sharing
    assert not lesson13.check_shared_blocks(  # shared by block content alone, ignoring what came before
        lambda prompts, b: len({tuple(p[i:i + b]) for p in prompts for i in range(0, len(p), b)}))
    assert not lesson13.check_ttft_prediction(lambda t, n, c: t * c / n)  # the cached share, not the computed one
    assert lesson13.check_steps_to_read(s.steps_to_read)
    assert not lesson13.check_steps_to_read(lambda p, b, r: -(-p // b))  # forgot the running requests' tokens
    assert not lesson13.check_steps_to_read(lambda p, b, r: p // (b - r))  # forgot the last, partial chunk
    assert lesson13.check_fork_blocks(s.fork_blocks)
    blocks = lambda t, b: -(-t // b)  # noqa: E731
    assert not lesson13.check_fork_blocks(lambda p, a, b=16: sum(blocks(p + t, b) for t in a))  # no sharing at all
    assert not lesson13.check_fork_blocks(  # the partial block shared too, never copied
        lambda p, a, b=16: blocks(p, b) + sum(blocks(t, b) for t in a))


def test_lesson14():
    from course_lib.exercises import lesson14
    s = solution(14, None, None)
    assert lesson14.check_speedup(s.speedup)
    assert lesson14.check_lookup(s.lookup)
    assert lesson14.check_tokens_per_verify(s.tokens_per_verify)
    assert not lesson14.check_speedup(lambda tpv, step, d, k, v: tpv * step / v)  # forgot the drafts' cost
    assert not lesson14.check_lookup(lambda c, k, n=2: c[:k])
    assert not lesson14.check_tokens_per_verify(lambda a, k: a * k)  # independent, not a chain


def test_lesson15(model, tokenizer):
    from course_lib.exercises import lesson15
    s = solution(15, model, tokenizer)
    assert lesson15.check_yes_no(s.yes_no_allowed, tokenizer)
    assert lesson15.check_after_age(s.allowed_after_age, tokenizer)
    assert lesson15.check_city_schema(s.city_schema, model, tokenizer)
    assert not lesson15.check_yes_no(lambda text: [2], tokenizer)
    assert not lesson15.check_after_age(lambda: [" 4", "4", "-"], tokenizer)
    assert not lesson15.check_city_schema(lambda: {"type": "object"}, model, tokenizer)


def test_lesson16():
    from course_lib.exercises import lesson16
    s = solution(16, None, None)
    assert lesson16.check_merge(s.merge_sums)
    assert lesson16.check_gather_bytes(s.gather_bytes)
    assert lesson16.check_tiles(s.tiles_computed)
    assert not lesson16.check_merge(lambda m1, l1, m2, l2: (max(m1, m2), l1 + l2))  # forgot to rescale
    assert not lesson16.check_gather_bytes(lambda r, t: 30 * r * t * 3 * 64 * 4)  # keys only
    assert not lesson16.check_tiles(lambda t, tile: (-(-t // tile)) ** 2)  # every tile, causal skips none
    assert not lesson16.check_tiles(lambda t, tile: (t // tile) * (t // tile + 1) // 2)  # forgot the partial tile


def test_lesson17():
    from course_lib.exercises import lesson17
    s = solution(17, None, None)
    assert lesson17.check_kv8_bytes(s.kv8_bytes)
    assert lesson17.check_outweighs(s.outweighs_at)
    assert lesson17.check_kept(s.kept)
    assert not lesson17.check_kv8_bytes(lambda t: 2 * 30 * 3 * 64 * t)  # forgot the scales
    assert not lesson17.check_outweighs(lambda w, p: w // p)  # rounded down
    assert not lesson17.check_kept(lambda n, b, k: list(range(max(0, n - b), n)))  # a plain window: no sinks
    assert not lesson17.check_kept(lambda n, b, k: list(range(k)) + list(range(n - (b - k), n)))  # evicts before full


def test_lesson18(model, tokenizer):
    from course_lib.exercises import lesson18
    from course_lib.runner.model import Model
    ours = Model.from_transformers(model)
    s = solution(18, ours, tokenizer)
    assert lesson18.check_wire_bytes(s.wire_bytes, ours)
    assert lesson18.check_tp_sizes(s.tp_sizes)
    assert lesson18.check_kv_link(s.kv_link_gbs)
    assert lesson18.shipped_bytes(ours, 10, "float32") == 2 * 30 * 3 * 64 * 4 * 10  # the check packs real frames
    assert not lesson18.check_wire_bytes(lambda t, f: 2 * 30 * 3 * 64 * 4 * t, ours)  # float32 whatever the format
    assert not lesson18.check_wire_bytes(lambda t, f: s.wire_bytes(t, f) // 2, ours)  # keys only
    assert not lesson18.check_wire_bytes(lambda t, f: 30 * 3 * 64 * t * (4 if f == "float32" else 2 if
                                                                           f == "bfloat16" else 1) * 2, ours)  # no scales
    assert not lesson18.check_tp_sizes(lambda kv, ff: [w for w in range(1, kv + 1) if kv % w == 0])  # heads only
    assert not lesson18.check_tp_sizes(lambda kv, ff: [1, 3])  # SmolLM2's answer for every model
    assert not lesson18.check_kv_link(lambda r, p, b: r * p * b)  # bytes, not GB
    assert not lesson18.check_kv_link(lambda r, p, b: p * b / 1e9)  # one request


# Wrong answers a learner could hand in without doing the exercise: a constant, a value the notebook printed,
# a copy of the lesson's own example, a non-streaming answer. Each must fail (the checks draw new cases per run).
WRONG = {
    "09 mean latency: the fixed case's 3.0": (lambda: lesson09.check_mean_latency(lambda jobs: 3.0)),
    "09 waste: a constant": (lambda: lesson09.check_waste(lambda lengths: 0.5)),
    "10 parse: the fixed stream's text": (lambda: lesson10.check_parse(lambda raw: "Paris.")),
    "10 ttft: the fixed case's 0.4": (lambda: lesson10.check_ttft(lambda start, arrivals: 0.4)),
    "10 body: the lesson's own question": (lambda: lesson10.check_body(lambda q: {
        "messages": [{"role": "user", "content": "What is the capital of France?"}], "stream": True, "max_tokens": 50})),
}


@pytest.mark.parametrize("name", list(WRONG))
def test_a_wrong_answer_fails_every_time(name, capsys):
    for _ in range(5):  # five draws of new cases
        assert not WRONG[name]()
    assert "❌" in capsys.readouterr().out


def test_failure_messages_do_not_give_the_answer(capsys):
    """The expected value is not printed when an answer is wrong: the learner sees the case and their answer."""
    seen = []

    def remember(jobs):
        seen.append(sum(j.end for j in jobs) / len(jobs))
        return -1.0

    assert not lesson09.check_mean_latency(remember)
    assert f"{seen[0]:.2f}" not in capsys.readouterr().out.replace("-1.0", "")
    times = []

    def remember_ttft(start, arrivals):
        times.append(min(arrivals) - start)
        return -1.0

    assert not lesson10.check_ttft(remember_ttft)
    out = capsys.readouterr().out
    assert f"{times[0]:.2f}" not in out and f"{times[0]:.3f}" not in out


def test_predict_then_measure(model, tokenizer, capital_logits, capsys):
    """Lessons 03, 05, 06, 07 and 09 ask for a prediction before the check measures: a learner's reasoning from the
    lesson's numbers passes, the naive guess each exercise is built to expose fails (on this CPU each is off by at
    least twice the measured value), and no prediction at all asks for one without measuring."""
    from course_lib.exercises import check_prediction
    from course_lib.measure.prefill_decode import decode_seconds
    from course_lib.measure.speed import throughput_latency
    from course_lib.runtime import time_it
    from course_lib.engine.sampling import SamplingConfig, reshape

    ids = chat_ids(tokenizer, "What is the capital of France?")
    s3 = solution(3, model, tokenizer)
    assert lesson03.check_pass_prediction(s3.pass_prediction(ids), model, ids)
    one_ms = time_it(lambda: forward_logits(model, ids[:1]), model.device, repeats=3).best * 1000
    assert not lesson03.check_pass_prediction(64 * one_ms, model, ids)  # n times a 1-token pass

    s5 = solution(5, model, tokenizer)
    assert lesson05.check_nucleus_prediction(s5.nucleus_prediction(capital_logits), capital_logits)
    at_one = reshape(capital_logits, SamplingConfig(top_p=0.9)).kept
    assert not lesson05.check_nucleus_prediction(1.5 * at_one, capital_logits)  # in proportion to the temperature

    story = story_ids(tokenizer)
    s6 = solution(6, model, tokenizer)
    assert lesson06.check_arrival_prediction(s6.arrival_prediction(story), model, tokenizer, story)
    first = generate(model, tokenizer, story, max_new_tokens=2).time_to_first_token
    assert not lesson06.check_arrival_prediction(first, model, tokenizer, story)  # the first token's time alone

    s7 = solution(7, model, tokenizer)
    assert lesson07.check_long_step_prediction(s7.long_step_prediction(), model, tokenizer)
    short_ms = decode_seconds(model, tokenizer, [200])[0] * 1000
    assert not lesson07.check_long_step_prediction(short_ms * 3000 / 200, model, tokenizer)  # in proportion

    s9 = solution(9, model, tokenizer)
    assert lesson09.check_batch_prediction(s9.batch_prediction(ids), model, ids)
    single = throughput_latency(model, ids, [1], 32)[0]["tokens_per_s"]
    assert not lesson09.check_batch_prediction(12 * single, model, ids)  # twelve times one request's rate

    capsys.readouterr()
    measured = []
    for empty in (None, 0, -1.0, True, "fast"):
        assert not check_prediction(empty, lambda: measured.append(1) or 1.0, unit="s", what="", tolerance=2, hint="")
    assert not measured  # nothing measured without a prediction
    assert capsys.readouterr().out.count("write your prediction first") == 5
    assert check_prediction(1.9, lambda: 1.0, unit="s", what="", tolerance=2, hint="")
    assert not check_prediction(2.1, lambda: 1.0, unit="s", what="", tolerance=2, hint="")
    assert not check_prediction(0.49, lambda: 1.0, unit="s", what="", tolerance=2, hint="")

    # timed=True: a near miss is measured twice more and judged by the median; a far miss, or an untimed check, once
    runs = iter([1.0, 0.8, 0.8])
    assert check_prediction(0.75, lambda: next(runs), unit="s", what="", tolerance=1.2, hint="", timed=True)
    assert "the median of 1, 0.8, 0.8" in capsys.readouterr().out
    runs = iter([1.0, 0.8, 1.1])
    assert not check_prediction(0.75, lambda: next(runs), unit="s", what="", tolerance=1.2, hint="", timed=True)
    calls = []
    assert not check_prediction(3.0, lambda: calls.append(1) or 1.0, unit="s", what="", tolerance=1.2, hint="",
                                timed=True)
    assert not check_prediction(0.75, lambda: calls.append(1) or 1.0, unit="s", what="", tolerance=1.2, hint="")
    assert len(calls) == 2


def test_predict_then_measure_in_the_other_lessons(model, tokenizer):
    """Lessons 00, 01, 02, 10, 14, 15, 16 and 17: a prediction reasoned from the lesson's own numbers passes, and the
    guess each exercise is built to expose fails."""
    from course_lib.runner import formats
    from course_lib.text.context import edit_ids
    from course_lib.exercises import lesson14, lesson15, lesson16, lesson17
    from course_lib.measure.long_context import step_curve
    from course_lib.runner.model import Model
    from course_lib.engine.structured import RECEIPT_SCHEMA

    context = chat_ids(tokenizer, "What is the capital of France?")
    s0 = solution(0, model, tokenizer)
    assert lesson00.check_loop_share_prediction(s0.loop_share_prediction(context), model, tokenizer, context)
    eight = generate(model, tokenizer, context, max_new_tokens=8, stop_ids=())
    assert not lesson00.check_loop_share_prediction((eight.steps[-1].at - eight.steps[0].at) / eight.steps[-1].at,
                                                    model, tokenizer, context)  # the 8-token run's share, unchanged

    s1 = solution(1, model, tokenizer)
    assert lesson01.check_count_prediction(s1.count_prediction(lesson01.SPANISH), tokenizer)
    from pathlib import Path
    english = (Path(__file__).resolve().parents[1] / "data" / "texts" / "english_prose.txt").read_text()
    english_rate = len(english) / len(tokenizer(english, add_special_tokens=False)["input_ids"])
    assert not lesson01.check_count_prediction(len(lesson01.SPANISH) / english_rate, tokenizer)  # English's rate

    s2 = solution(2, model, tokenizer)
    assert lesson02.check_context_prediction(s2.context_prediction(lesson02.PREDICT_CHAT), tokenizer)
    assert not lesson02.check_context_prediction(sum(lesson02.text_tokens(tokenizer)), tokenizer)  # the texts alone

    s10 = solution(10, model, tokenizer)
    assert lesson10.check_load_prediction(s10.load_prediction(), model, tokenizer)
    assert not lesson10.check_load_prediction(5.0, model, tokenizer)  # a decode step's time, no queue, no prefill

    ours = Model.from_transformers(model)
    edit = edit_ids(tokenizer)
    s14 = solution(14, ours, tokenizer)
    assert lesson14.check_verify_prediction(s14.verify_prediction(edit), ours, tokenizer, edit)
    assert not lesson14.check_verify_prediction(5, ours, tokenizer, edit)  # k + 1: every draft accepted

    s15 = solution(15, model, tokenizer)
    assert lesson15.check_inside_string_prediction(s15.inside_string_prediction(), tokenizer, RECEIPT_SCHEMA)
    assert not lesson15.check_inside_string_prediction(100, tokenizer, RECEIPT_SCHEMA)  # a handful of letters

    s16 = solution(16, ours, tokenizer)
    assert lesson16.check_step_prediction(s16.step_prediction(), ours)
    from course_lib.measure.attention import step_times
    quarter = step_times(ours, 4, 250, 16, repeats=3)["paged_ms"]
    assert not lesson16.check_step_prediction(quarter * 2000 / 250, ours)  # in proportion to the context

    int4 = formats.convert(ours, "int4")
    s17 = solution(17, int4, tokenizer)
    assert lesson17.check_step_prediction(s17.step_prediction(), int4)
    short = step_curve(int4, [256], repeats=5)[0]["ms"]
    assert not lesson17.check_step_prediction(short * 6000 / 256, int4)  # in proportion to the context
    assert not lesson17.check_step_prediction(short, int4)  # flat: the cache's reads left out

    from course_lib.exercises import lesson18
    s18 = solution(18, ours, tokenizer)
    assert lesson18.check_shipped_prediction(s18.shipped_prediction(), ours, tokenizer)
    assert not lesson18.check_shipped_prediction(s18.wire_bytes(2000, "float32") / 1e6, ours, tokenizer)  # float32's
    assert not lesson18.check_shipped_prediction(s18.wire_bytes(2000, "int8") / 1e6, ours, tokenizer)  # the 8-bit one

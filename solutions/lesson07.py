import numpy

from course_lib.measure.speed import cached_run, uncached_run

model = tokenizer = None


def kv_bytes(tokens, layers, kv_heads, head_dim, bytes_per_number):
    return 2 * tokens * layers * kv_heads * head_dim * bytes_per_number


def positions_without_cache(prompt_len, n_new):
    return sum(prompt_len + i for i in range(n_new))


def ratio(prompt, n_new=48):
    return uncached_run(model, prompt, n_new).total / cached_run(model, tokenizer, prompt, n_new).total


def long_step_prediction(context=3000):
    """A least-squares line through the step's cost at four shorter contexts (each the median of 9 steps),
    extended to `context`: a line through two points lets one slow step tilt it."""
    from course_lib.measure.prefill_decode import decode_timings
    xs = [500, 1000, 1500, 2000]
    ys = [t.median * 1000 for t in decode_timings(model, tokenizer, xs, steps=9)]
    slope, intercept = numpy.polyfit(xs, ys, 1)
    return float(intercept + slope * context)

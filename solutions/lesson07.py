from course_lib.measure.speed import cached_run, uncached_run

model = tokenizer = None


def kv_bytes(tokens, layers, kv_heads, head_dim, bytes_per_number):
    return 2 * tokens * layers * kv_heads * head_dim * bytes_per_number


def positions_without_cache(prompt_len, n_new):
    return sum(prompt_len + i for i in range(n_new))


def ratio(prompt, n_new=48):
    return uncached_run(model, prompt, n_new).total / cached_run(model, tokenizer, prompt, n_new).total


def long_step_prediction(context=3000):
    """A straight line through the step's cost at two shorter contexts, extended to `context`."""
    from course_lib.measure.prefill_decode import decode_seconds
    short, longer = 200, 1200
    a, b = decode_seconds(model, tokenizer, [short, longer])
    return 1000 * (a + (b - a) * (context - short) / (longer - short))

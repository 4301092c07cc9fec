from course_lib.measure.speed import cached_run, uncached_run

model = tokenizer = None


def kv_bytes(tokens, layers, kv_heads, head_dim, bytes_per_number):
    return 2 * tokens * layers * kv_heads * head_dim * bytes_per_number


def positions_without_cache(prompt_len, n_new):
    return sum(prompt_len + i for i in range(n_new))


def ratio(prompt, n_new=48):
    return uncached_run(model, prompt, n_new).total / cached_run(model, tokenizer, prompt, n_new).total

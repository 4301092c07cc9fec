from course_lib.measure.prefill_decode import decode_seconds, prefill_seconds

model = tokenizer = None


def achieved_bandwidth(weight_bytes, seconds_per_token):
    return weight_bytes / seconds_per_token


def crossover_context(weight_bytes, kv_bytes_per_token, batch):
    return int(weight_bytes // (kv_bytes_per_token * batch))


def ratio(n=256):
    prefill_tps = n / prefill_seconds(model, tokenizer, [n])[0]
    decode_tps = 1 / decode_seconds(model, tokenizer, [n])[0]
    return prefill_tps / decode_tps


def ttft_prediction(n=2000):
    """From the longest prompt of section 1, scaled to n tokens (a little optimistic: attention grows faster)."""
    return n / (1024 / prefill_seconds(model, tokenizer, [1024])[0]) * 1.2

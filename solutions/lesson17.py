"""Solutions for 17_long_context."""
import math

model = tokenizer = None


def kv8_bytes(tokens):
    return 2 * 30 * 3 * (64 + 2) * tokens  # keys and values, layers, KV heads, 64 bytes and a 2-byte scale


def outweighs_at(weight_bytes, per_token):
    return math.ceil(weight_bytes / per_token)


def kept(n, budget, sinks):
    if n <= budget:
        return list(range(n))
    return list(range(sinks)) + list(range(n - (budget - sinks), n))

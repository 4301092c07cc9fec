"""Solutions for 18_beyond_one_machine."""
model = tokenizer = None


def wire_bytes(tokens, fmt):
    layers, kv_heads, head_dim = len(model.layers), model.kv_heads, model.head_dim
    per_number = {"float32": 4, "bfloat16": 2}
    row = head_dim * per_number[fmt] if fmt in per_number else head_dim + 2  # int8: one byte each and a 2-byte scale
    return 2 * layers * kv_heads * tokens * row


def tp_sizes(kv_heads, ff):
    return [w for w in range(1, kv_heads + 1) if kv_heads % w == 0 and ff % w == 0]


def kv_link_gbs(rate, prompt_tokens, kv_bytes_per_token):
    return rate * prompt_tokens * kv_bytes_per_token / 1e9


def shipped_prediction(tokens=2000, fmt="bfloat16"):
    """From section 2's bytes per prompt token, times the tokens."""
    return wire_bytes(tokens, fmt) / 1e6

"""Solutions for 13_paged_memory."""

model = tokenizer = None


def blocks_needed(prompt_tokens, new_tokens, block_size=16):
    return -(-(prompt_tokens + new_tokens) // block_size)


def shared_blocks(prompts, block_size):
    named = set()  # the prefixes (as tuples) of full blocks already in the pool
    total = 0
    for tokens in prompts:
        reusable = (len(tokens) - 1) // block_size  # the last token's block is always computed
        hit = 0
        while hit < reusable and tuple(tokens[:(hit + 1) * block_size]) in named:
            hit += 1
        total += -(-len(tokens) // block_size) - hit
        for i in range(len(tokens) // block_size):
            named.add(tuple(tokens[:(i + 1) * block_size]))
    return total


def predict_ttft(ttft_no_hit_s, prompt_tokens, cached_tokens):
    return ttft_no_hit_s * (prompt_tokens - cached_tokens) / prompt_tokens


def steps_to_read(prompt_tokens, token_budget, running):
    return -(-prompt_tokens // (token_budget - running))


def fork_blocks(prompt_tokens, answer_tokens, block_size=16):
    full, partial = divmod(prompt_tokens, block_size)  # full blocks are shared; the partial one is copied on write
    return full + sum(-(-(partial + t) // block_size) for t in answer_tokens)

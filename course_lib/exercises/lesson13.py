"""Checks for 13_paged_memory: blocks a conversation takes, blocks shared by prompts, a prefix hit's first token,
the steps a chunked prompt takes, and the blocks n forked answers hold."""
from __future__ import annotations

from ..runner.blocks import BLOCK_SIZE, Sequence, blocks_for
from ..runner.paged import BlockPool, footprint
from . import fresh, off, safely, verdict


def check_blocks_needed(blocks_needed) -> bool:
    """blocks_needed(prompt_tokens, new_tokens, block_size=16) -> blocks one conversation holds at its end."""
    for case in [(37, 96, 16), (16, 0, 16), (17, 0, 16), (1127, 96, 16), (5, 3, 4)]:
        ok, got = safely(blocks_needed, *case)
        if not ok:
            return verdict(False, "", got)
        want = blocks_for(case[0] + case[1], case[2])
        if got != want:
            return verdict(False, "", f"for {case} you said {got!r}, expected {want}. Hint: every token needs a slot, "
                           "a block has block_size slots, and a block that is only partly full still counts")
    return verdict(True, "a 1,127-token question with 96 new tokens holds 77 blocks: 1,232 slots for 1,223 tokens", "")


def pool_blocks(prompts: list[list[int]], block_size: int) -> int:
    """Blocks in use once every prompt is admitted and prefilled, one after another, none finished: what the
    course's pool really does (paged.footprint runs the real block manager; no model needed)."""
    return footprint(prompts, block_size)["blocks"]


def check_shared_blocks(shared_blocks) -> bool:
    """shared_blocks(prompts, block_size) -> blocks the pool holds for these prompts, all still running."""
    cases = [([[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 7, 8], [9, 9, 9, 9, 9]], 2),
             ([[1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 4, 5, 6, 7, 8, 1]], 4),
             ([[5, 5, 5, 5], [5, 5, 5, 5]], 2),
             ([[1, 2, 3], [2, 1, 3]], 1)]
    for prompts, size in cases:
        ok, got = safely(shared_blocks, [list(p) for p in prompts], size)
        if not ok:
            return verdict(False, "", got)
        want = pool_blocks(prompts, size)
        if got != want:
            return verdict(False, "", f"for {prompts} in blocks of {size} you said {got!r}, the pool holds {want}. Hint: "
                           "a full block is shared only if every token before it matches too; a partial block is "
                           "never shared; and a prompt's last token is always computed, so its block is its own")
    return verdict(True, "two identical 4-token prompts in blocks of 2 hold 3 blocks, not 2: the second one's last "
                   "block is recomputed so its last token has logits", "")


def check_ttft_prediction(predict_ttft) -> bool:
    """predict_ttft(ttft_no_hit_s, prompt_tokens, cached_tokens) -> the time to first token if prefill time
    is proportional to the tokens it computes."""
    for case in [(2.0, 1000, 900), (1.0, 100, 0), (3.5, 1127, 1104)]:
        ok, got = safely(predict_ttft, *case)
        if not ok:
            return verdict(False, "", got)
        want = case[0] * (case[1] - case[2]) / case[1]
        if not isinstance(got, (int, float)) or abs(got - want) > 1e-9:
            return verdict(False, "", f"for {case} you said {got!r}, expected {want:.4f}. Hint: only the tokens that "
                           "are not cached are computed")
    return verdict(True, "the next cell compares this rule with the measurement", "")


def check_steps_to_read(steps_to_read) -> bool:
    """steps_to_read(prompt_tokens, token_budget, running) -> steps a PagedScheduler takes to read a prompt when
    `running` requests decode one token each per step and the prompt gets the rest of the budget."""
    for case in [(1100, 128, 1), (100, 256, 3), (1000, 64, 8), (127, 128, 1), (128, 128, 1), (5, 16, 0)]:
        ok, got = safely(steps_to_read, *case)
        if not ok:
            return verdict(False, "", got)
        prompt, budget, running = case
        want = -(-prompt // (budget - running))
        if got != want:
            return verdict(False, "", f"for {case} you said {got!r}, expected {want}. Hint: the running requests take "
                           "one token of the budget each, every step; a last, partial chunk is one more step")
    return verdict(True, "a 1,100-token prompt beside one running request takes 9 steps at a budget of 128", "")


def fork_footprint(prompt_tokens: int, answer_tokens: list[int], block_size: int = BLOCK_SIZE) -> int:
    """Blocks a pool holds for len(answer_tokens) answers to one prompt of `prompt_tokens` tokens, the answers after
    the first forked from it (BlockPool.fork) and each written up to its own length (copy-on-write): runs the real
    block manager on a pool of one-number entries, no model. Example: fork_footprint(40, [5, 5]) -> 4 (two full
    prompt blocks shared, and each answer's own copy of the partial third block)"""
    total = blocks_for(prompt_tokens + max(answer_tokens, default=0), block_size) * max(1, len(answer_tokens))
    pool = BlockPool(1, 1, 1, total, block_size, prefix_caching=False)
    first = Sequence(list(range(prompt_tokens)))
    pool.grow(first, prompt_tokens)
    pool.commit(first, prompt_tokens)
    seqs = [first] + [pool.fork(first) for _ in answer_tokens[1:]]
    for seq, extra in zip(seqs, answer_tokens):
        pool.writable(seq, prompt_tokens, prompt_tokens + extra)
        pool.grow(seq, prompt_tokens + extra)
    return pool.manager.num_used


def check_fork_blocks(fork_blocks) -> bool:
    """fork_blocks(prompt_tokens, answer_tokens, block_size=16) -> blocks the pool holds for len(answer_tokens)
    answers forked from one prompt, answer i having answer_tokens[i] tokens (each at least one). One case is drawn
    anew at every run, so a table of the fixed cases' answers does not pass."""
    rng = fresh()
    drawn = (rng.randint(1, 3000), [rng.randint(1, 200) for _ in range(rng.randint(1, 8))], rng.choice([4, 16, 32]))
    for case in [(1127, [16, 16, 16, 16], 16), (40, [5, 5], 16), (32, [3, 20, 1], 16), (1127, [30], 16),
                 (10, [2, 2, 9], 4), drawn]:
        ok, got = safely(fork_blocks, *case)
        if not ok:
            return verdict(False, "", got)
        want = fork_footprint(*case)
        if got != want:
            return verdict(False, "", f"for {case} you said {got!r}: {off(got, want)}. Hint: the prompt's full "
                           "blocks are held once by all the answers; its partial last block is copied by each answer "
                           "that writes into it (copy-on-write); then each answer fills blocks of its own")
    return verdict(True, "four 16-token answers to the 1,127-token handbook question hold 78 blocks forked, "
                   "against 4 x 72 = 288 as separate requests", "")

"""The bookkeeping of a paged KV cache, in pure Python: blocks, who holds them, and their prefix names.

What it does: `BlockManager` hands out the blocks of a pool, counts who uses each (reference counts, so prompts
that start alike share blocks) and takes them back, least recently used first, keeping a freed block's prefix name
until the block is needed again; `block_hash` / `prefix_hashes` name a full block by a hash chained over its
parent's name and its own tokens (and a cache salt: `salt_root`); `Sequence` is one request's tokens and block
table; `blocks_for` counts the blocks a number of tokens needs. No tensors: paged.py's BlockPool holds the keys and
values these blocks number.
What it does not do: store keys and values (paged.BlockPool), or schedule requests (paged_scheduler.py).
"""
from __future__ import annotations

import hashlib
import random
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

BLOCK_SIZE = 16  # tokens per block (vLLM's default too)


class OutOfBlocks(RuntimeError):
    """No free block is left in the pool (the scheduler preempts or waits)."""


def block_hash(parent: bytes | None, tokens) -> bytes:
    """The name of a full block: a hash of its parent's name and its own tokens, so equal names mean equal
    prefixes, not only equal blocks. Example: block_hash(None, [1, 2]) != block_hash(block_hash(None, [0]), [1, 2])"""
    h = hashlib.sha256(parent or b"root")
    h.update(torch.tensor(list(tokens), dtype=torch.int64).numpy().tobytes())
    return h.digest()[:16]


def salt_root(salt: str = "") -> bytes | None:
    """The parent of a sequence's first block: none, or a digest of its cache salt. Sequences with different
    salts never share a block, even with equal tokens (vLLM's `cache_salt`): without it, anyone who can time a
    request can tell whether another user sent the same prefix (a hit answers much sooner, section 3)."""
    return hashlib.sha256(b"salt:" + salt.encode("utf-8")).digest()[:16] if salt else None


def prefix_hashes(tokens, block_size: int = BLOCK_SIZE, salt: str = "") -> list[bytes]:
    """The chained names of every full block of these tokens (a partial last block has none); `salt` separates
    caches (salt_root). Example: 40 tokens, blocks of 16 -> 2 names"""
    names, parent = [], salt_root(salt)
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = block_hash(parent, tokens[start:start + block_size])
        names.append(parent)
    return names


def blocks_for(tokens: int, block_size: int = BLOCK_SIZE) -> int:
    """Blocks that hold this many tokens. Example: 33 tokens, blocks of 16 -> 3"""
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
        raise ValueError(f"a block holds a whole number of tokens >= 1, got {block_size!r}")
    return -(-tokens // block_size)


class BlockManager:
    """Who holds which block. ref[b]: how many sequences use block b. `free`: blocks nobody uses, least
    recently used first (a block that holds a cached prefix stays named until it is handed out again)."""

    def __init__(self, num_blocks: int, block_size: int = BLOCK_SIZE):
        if not isinstance(num_blocks, int) or isinstance(num_blocks, bool) or num_blocks < 1:
            raise ValueError(f"the pool needs a whole number of blocks >= 1, got {num_blocks!r}")
        if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
            raise ValueError(f"a block holds a whole number of tokens >= 1, got {block_size!r}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.ref = [0] * num_blocks
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.by_hash: dict[bytes, int] = {}  # cached prefix name -> block
        self.hash_of: dict[int, bytes] = {}
        self.evicted = 0  # cached blocks handed out again (their prefix forgotten)

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free)

    def allocate(self) -> int:
        """A block for one sequence (ref 1): the least recently used free one; if it held a cached prefix,
        that prefix is forgotten."""
        if not self.free:
            raise OutOfBlocks(f"all {self.num_blocks} blocks are in use")
        block, _ = self.free.popitem(last=False)
        if block in self.hash_of:
            del self.by_hash[self.hash_of.pop(block)]
            self.evicted += 1
        self.ref[block] = 1
        return block

    def acquire(self, block: int) -> None:
        """One more sequence uses this (cached) block."""
        if self.ref[block] == 0:
            del self.free[block]
        self.ref[block] += 1

    def release(self, block: int) -> None:
        """A sequence is done with this block. At 0 users it becomes free: a named block goes to the back of
        the line (its prefix may be asked for again), an unnamed one to the front (it holds nothing reusable)."""
        if self.ref[block] <= 0:
            raise ValueError(f"block {block} is not in use: released twice?")
        self.ref[block] -= 1
        if self.ref[block] == 0:
            self.free[block] = None
            if block not in self.hash_of:
                self.free.move_to_end(block, last=False)

    def match(self, names: list[bytes]) -> list[int]:
        """The cached blocks for the longest run of these prefix names, from the first."""
        blocks = []
        for name in names:
            if name not in self.by_hash:
                break
            blocks.append(self.by_hash[name])
        return blocks

    def register(self, block: int, name: bytes) -> None:
        """Name a block that just became full, so later prompts can reuse it (the first block of a name wins)."""
        if name not in self.by_hash and block not in self.hash_of:
            self.by_hash[name], self.hash_of[block] = block, name

    def forget(self, block: int) -> None:
        """The block's contents no longer match its name (a rollback): it can no longer be found as a prefix."""
        if block in self.hash_of:
            del self.by_hash[self.hash_of.pop(block)]

    def shuffle(self, seed: int = 0) -> None:
        """Hand the free blocks out in a random order from now on, as a pool does after many requests have come
        and gone (a sequence's blocks then rarely lie side by side). Lessons and benchmarks use it."""
        order = list(self.free)
        random.Random(seed).shuffle(order)
        self.free = OrderedDict((b, None) for b in order)

    def check(self) -> None:
        """The invariants, checked (the tests call this after every trace)."""
        assert all(r >= 0 for r in self.ref), "a reference count went negative"
        assert set(self.free) == {b for b, r in enumerate(self.ref) if r == 0}, "free list and counts disagree"
        assert all(self.hash_of[b] == name for name, b in self.by_hash.items()), "hash tables disagree"


@dataclass
class Sequence:
    """One request's tokens and where their keys and values live."""
    tokens: list[int]  # every token known: the prompt, then each token as it is picked
    blocks: list[int] = field(default_factory=list)  # the block table: logical block i is physical blocks[i]
    computed: int = 0  # tokens whose keys and values are in the blocks
    names: list[bytes] = field(default_factory=list)  # the chained name of each full block, in order
    reused: int = 0  # tokens taken from the prefix cache when it was admitted
    was_computed: int = 0  # tokens it had computed when it was last preempted (recomputing redoes them)
    preempted: int = 0  # times it was preempted (a scheduler counts them)
    salt: str = ""  # its cache salt: blocks are shared only with sequences of the same salt

    def slot(self, position: int, block_size: int) -> int:
        """Where token `position` lives in the pool: its block's first slot plus the offset in the block."""
        return self.blocks[position // block_size] * block_size + position % block_size

"""The paged KV cache (lesson 13): one pool of fixed-size blocks, read through block tables, with prefix caching.

What it does: `BlockPool` keeps every layer's keys and values in one pool of blocks of `block_size` token slots,
and owns the BlockManager (blocks.py) that hands them out: admitting a sequence with the cached blocks of its
longest cached prefix (prefix caching: the last prompt token is always computed, so there are logits to pick
from, and a shared block is never written), growing it block by block, naming blocks as they fill, forking it
copy-on-write, freeing it. `PagedCache` is several sequences seen as one batch: what the model is called with. It
meets the same contract as kv_cache.KVCache (length, reserve, write, rollback), so the stages run it unchanged.
Decode attention reads the blocks through the block tables, a tile of blocks at a time
(attention_kernels.paged_decode, lesson 16: `attention="paged"`, the default); `attention="gather"` copies every
row's keys and values into one padded tensor per layer first, the reference it is tested against. A prompt's
prefill (one row, several tokens) always reads through the gather.
What it does not do: schedule requests or preempt them (paged_scheduler.PagedScheduler does), run a custom kernel
(the paged path is torch operators: on the CPU, torch's fused flash kernel per tile), or share a partly filled
block.
"""
from __future__ import annotations

import torch

from .attention_kernels import TILE_TOKENS, decode_plan, paged_decode
from .blocks import BLOCK_SIZE, BlockManager, OutOfBlocks, Sequence, block_hash, blocks_for, prefix_hashes, salt_root

ATTENTION = ("paged", "gather")  # how decode attention reads the pool: through the tables in tiles, or a full copy


class BlockPool:
    """The pool: per layer, keys and values for num_blocks x block_size token slots, (slots, KV, D), and the
    block manager that hands the blocks out. Example: pool = BlockPool.for_model(ours, num_blocks=64)"""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, num_blocks: int, block_size: int = BLOCK_SIZE,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu", prefix_caching: bool = True,
                 attention: str = "paged", tile_tokens: int = TILE_TOKENS):
        if attention not in ATTENTION:
            raise ValueError(f"decode attention is one of {ATTENTION}, got {attention!r}")
        self.attention, self.tile_tokens = attention, tile_tokens
        self.manager = BlockManager(num_blocks, block_size)
        shape = (num_blocks * block_size, kv_heads, head_dim)  # (slots, KV, D)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.block_size, self.prefix_caching = block_size, prefix_caching
        self.lookups = self.hits = 0  # prompt tokens asked for, and found, in the prefix cache (first admissions)
        self.readmitted = self.refound = 0  # the same for preempted sequences coming back (their own blocks, often)
        self.copied = 0  # blocks copied on write (a fork's shared block written for the first time)

    @classmethod
    def for_model(cls, model, num_blocks: int, block_size: int = BLOCK_SIZE, prefix_caching: bool = True,
                  attention: str = "paged"):
        """A pool shaped for the course's model (model.Model): its layers, heads, dtype and device."""
        return cls(len(model.layers), model.kv_heads, model.head_dim, num_blocks, block_size, model.dtype,
                   model.device, prefix_caching, attention)

    @property
    def block_bytes(self) -> int:
        """Bytes of one block: keys and values of block_size tokens in every layer."""
        k = self.keys[0]
        return 2 * len(self.keys) * self.block_size * k.shape[1] * k.shape[2] * k.element_size()

    def nbytes(self) -> int:
        """Bytes the whole pool holds, used or not."""
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)

    def used_bytes(self) -> int:
        """Bytes of the blocks some sequence holds (a shared block counted once)."""
        return self.manager.num_used * self.block_bytes

    @property
    def hit_rate(self) -> float:
        """Share of the prompt tokens of first admissions found in the prefix cache. A preempted sequence that
        comes back often finds its own blocks still cached: that is counted apart (`refound_rate`), not as
        sharing."""
        return self.hits / self.lookups if self.lookups else 0.0

    @property
    def refound_rate(self) -> float:
        """Share of the tokens of readmitted (preempted) sequences found in the cache."""
        return self.refound / self.readmitted if self.readmitted else 0.0

    # ----- a sequence's life -----
    def reusable(self, seq: Sequence) -> tuple[list[bytes], list[int]]:
        """(the names of the sequence's full blocks, the cached blocks it may reuse). note: at most
        (len - 1) // block_size blocks, so the last token is always run (its logits pick the next token)
        and lands in a block of its own."""
        names = prefix_hashes(seq.tokens, self.block_size, seq.salt)
        reuse = self.manager.match(names)[:(len(seq.tokens) - 1) // self.block_size] if self.prefix_caching else []
        return names, reuse

    def admit(self, seq: Sequence) -> int:
        """Give a new (or recomputed) sequence the cached blocks of its longest cached prefix (`reusable`);
        returns how many of its tokens are already computed."""
        names, reuse = self.reusable(seq)
        for block in reuse:
            self.manager.acquire(block)
        seq.blocks, seq.names = list(reuse), names[:len(reuse)]
        seq.computed = seq.reused = len(reuse) * self.block_size
        if seq.preempted:  # back after a preemption
            self.readmitted, self.refound = self.readmitted + len(seq.tokens), self.refound + seq.computed
        else:
            self.lookups, self.hits = self.lookups + len(seq.tokens), self.hits + seq.computed
        return seq.computed

    def admit_cost(self, seq: Sequence, extra: int = 0) -> int:
        """Free blocks admitting this sequence would take (its cached prefix counted as free, as admit would),
        for `extra` more tokens than it has."""
        _, reuse = self.reusable(seq)
        idle = sum(1 for b in reuse if self.manager.ref[b] == 0)  # cached but free: taking them uses free blocks
        return blocks_for(len(seq.tokens) + extra, self.block_size) - len(reuse) + idle

    def grow(self, seq: Sequence, tokens: int) -> None:
        """Allocate blocks until `tokens` tokens fit in the sequence's table (raises OutOfBlocks, keeping what
        it got, if the pool runs dry)."""
        while len(seq.blocks) * self.block_size < tokens:
            seq.blocks.append(self.manager.allocate())

    def commit(self, seq: Sequence, n: int) -> None:
        """n more tokens of the sequence are now computed; blocks that became full get their names."""
        seq.computed += n
        while self.prefix_caching and len(seq.names) < seq.computed // self.block_size:
            i = len(seq.names)
            parent = seq.names[-1] if seq.names else salt_root(seq.salt)
            seq.names.append(block_hash(parent, seq.tokens[i * self.block_size:(i + 1) * self.block_size]))
            self.manager.register(seq.blocks[i], seq.names[-1])

    def fork(self, seq: Sequence) -> Sequence:
        """A second sequence that continues from the same tokens (parallel sampling, n > 1; beam search): it takes
        the same blocks, shared by reference count, and nothing is copied yet. The first time either writes into a
        block they share (their last, partly filled one), that block is copied (copy-on-write, `writable`)."""
        for block in seq.blocks:
            self.manager.acquire(block)
        return Sequence(list(seq.tokens), list(seq.blocks), seq.computed, list(seq.names), reused=seq.computed,
                        salt=seq.salt)  # note: reused, so it never rolls back into what it shares

    def writable(self, seq: Sequence, start: int, end: int) -> None:
        """Make the blocks that positions [start, end) are written to the sequence's own: a block another
        sequence also holds is copied to a fresh block first (all layers' keys and values), and the sequence's
        table points to the copy. Full shared blocks are never written (appends only), so in practice this is a
        fork's last, partial block."""
        bs = self.block_size
        for i in range(start // bs, min(len(seq.blocks), -(-end // bs))):
            old = seq.blocks[i]
            if self.manager.ref[old] <= 1:
                continue
            new = self.manager.allocate()
            src, dst = slice(old * bs, (old + 1) * bs), slice(new * bs, (new + 1) * bs)
            for keys, values in zip(self.keys, self.values):
                keys[dst], values[dst] = keys[src], values[src]
            self.manager.release(old)
            seq.blocks[i] = new
            self.copied += 1

    def free(self, seq: Sequence) -> None:
        """The sequence ends (or is preempted): its blocks go back, the last first, so a prefix's early blocks
        (the most shared) are the last to be forgotten."""
        for block in reversed(seq.blocks):
            self.manager.release(block)
        seq.blocks, seq.names, seq.computed = [], [], 0

    def view(self, seqs: list[Sequence]) -> "PagedCache":
        return PagedCache(self, seqs)


class PagedCache:
    """Several sequences as one batch for the model: what model.Model calls `cache`. Rows are right-aligned:
    row r's computed tokens fill columns [start - n_r, start) and the new tokens columns [start, start + T),
    start = the longest row; `attention_mask(T)` marks the padding. One row: any T; several: T = 1 (decode)."""

    def __init__(self, pool: BlockPool, seqs: list[Sequence]):
        self.pool, self.seqs = pool, seqs
        self._write = self._read = self._plan = None

    @property
    def length(self) -> int:
        return max(s.computed for s in self.seqs)

    @length.setter
    def length(self, end: int) -> None:  # the model sets this after its last layer: the new tokens are in
        new = end - self.length
        for s in self.seqs:
            self.pool.commit(s, new)

    def rollback(self, length: int) -> None:
        """Forget every column from `length` on (the cache contract's rollback): each row drops as many of its
        latest tokens; blocks named for tokens that are dropped lose their names (their slots will be
        rewritten), and the blocks stay in the table for the tokens that come next."""
        if not 0 <= length <= self.length:
            raise ValueError(f"can only roll back to a length in [0, {self.length}], got {length}")
        drop, bs = self.length - length, self.pool.block_size
        for s in self.seqs:
            if s.computed - drop < s.reused:  # note: those blocks may be shared; they are never written
                raise ValueError(f"cannot roll back a row below the {s.reused} tokens it reuses from the prefix cache")
        for s in self.seqs:
            s.computed -= drop
            while len(s.names) > s.computed // bs:
                s.names.pop()
                self.pool.manager.forget(s.blocks[len(s.names)])

    def attention_mask(self, new: int = 1) -> torch.Tensor:
        """(B, start + new): 1 where a row has a token, 0 where it is padding."""
        start = self.length
        mask = torch.zeros(len(self.seqs), start + new, dtype=torch.long)
        for row, s in enumerate(self.seqs):
            mask[row, start - s.computed:] = 1
        return mask

    def positions(self) -> torch.Tensor:
        """(B,): the position of each row's next token."""
        return torch.tensor([s.computed for s in self.seqs], dtype=torch.long)

    def reserve(self, end: int) -> None:
        """Called by the model before its first layer: work out, once for all layers, which slots this step
        writes (the new tokens) and reads (every row's tokens, through its block table)."""
        new = end - self.length
        if len(self.seqs) > 1 and new != 1:
            raise ValueError(f"a paged batch of {len(self.seqs)} rows decodes one token per row, got {new}: "
                             "prefill each prompt alone")
        for s in self.seqs:  # a block shared with a fork is copied before it is written
            self.pool.writable(s, s.computed, s.computed + new)
        if new == 1 and self.pool.attention == "paged":  # decode: attention walks the tables (`attend`)
            self._write, self._read = self.slots(new, reads=False)
            self._plan = decode_plan(self.tables(), self.positions() + 1, self.pool.block_size, self.pool.tile_tokens,
                                     dtype=self.pool.keys[0].dtype)
        else:
            self._write, self._read = self.slots(new)
            self._plan = None

    @property
    def reads_in_place(self) -> bool:
        """True when this step's attention goes through `attend` (the tables, in tiles), not `write`'s copy."""
        return self._plan is not None

    def tables(self) -> torch.Tensor:
        """(B, N) every row's block table, shorter rows padded with their first block (masked by length)."""
        n = max(len(s.blocks) for s in self.seqs)
        return torch.tensor([s.blocks + [s.blocks[0]] * (n - len(s.blocks)) for s in self.seqs],
                            dtype=torch.long, device=self.pool.keys[0].device)

    def slots(self, new: int, reads: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(slots the new tokens go to (B * new,), slots each row reads (B, S)), S = start + new (None if not reads)."""
        start, bs = self.length, self.pool.block_size
        write, read = [], []
        for s in self.seqs:
            if len(s.blocks) * bs < s.computed + new:
                raise OutOfBlocks(f"the sequence holds {len(s.blocks)} blocks, too few for {s.computed + new} "
                                  "tokens: call pool.grow(seq, tokens) first")
            write += [s.slot(p, bs) for p in range(s.computed, s.computed + new)]
            if not reads:
                continue
            past = [s.slot(p, bs) for p in range(s.computed + new)]
            read.append([past[0]] * (start + new - len(past)) + past)  # padding columns point anywhere: masked out
        device = self.pool.keys[0].device
        return (torch.tensor(write, dtype=torch.long, device=device),  # (B * new,)
                torch.tensor(read, dtype=torch.long, device=device) if reads else None)  # (B, S)

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, start: int):
        """Store (B, KV, T, D) keys and values in their slots; return every row's keys and values, (B, KV, S, D),
        gathered through the block tables (the copy a paged attention kernel avoids)."""
        B, KV, T, D = k.shape
        keys, values = self.pool.keys[layer], self.pool.values[layer]
        keys[self._write] = k.transpose(1, 2).reshape(B * T, KV, D)
        values[self._write] = v.transpose(1, 2).reshape(B * T, KV, D)
        if self._read is None:
            raise RuntimeError("this decode step reads the pool in place: call attend(), not write()")
        return keys[self._read].transpose(1, 2), values[self._read].transpose(1, 2)  # (B, KV, S, D)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """A decode step's attention without the copy: store each row's new key and value (B, KV, 1, D) in its
        slot, then attend q (B, H, 1, D) to every row's tokens through the block tables, a tile of blocks at a
        time (attention_kernels.paged_decode). Returns (B, H, 1, D)."""
        B, KV, _, D = k.shape
        keys, values = self.pool.keys[layer], self.pool.values[layer]
        keys[self._write] = k.reshape(B, KV, D)
        values[self._write] = v.reshape(B, KV, D)
        return paged_decode(q[:, :, 0], keys, values, self._plan, self.pool.block_size).unsqueeze(2)


def footprint(sequences: list[list[int]], block_size: int = BLOCK_SIZE) -> dict:
    """What a pool holds for these token sequences, admitted in order and all still running, with prefix caching:
    blocks in use, slots they hold, slots standing empty (each sequence's last, partial block), blocks shared,
    and block-table entries. Runs the real block manager (a pool with one-number entries: no model needed).
    Example: footprint([[1, 2, 3], [1, 2, 4]], 2) -> 3 blocks ([1, 2] shared by both), 6 slots, 2 of them empty"""
    pool = BlockPool(1, 1, 1, sum(blocks_for(len(s), block_size) for s in sequences) or 1, block_size)
    seqs = []
    for tokens in sequences:
        seq = Sequence(list(tokens))
        pool.admit(seq)
        pool.grow(seq, len(tokens))
        pool.commit(seq, len(tokens) - seq.computed)
        seqs.append(seq)
    used = pool.manager.num_used
    return {"block_size": block_size, "tokens": sum(len(s) for s in sequences), "blocks": used,
            "slots": used * block_size, "empty_slots": sum(len(s.blocks) * block_size - len(s.tokens) for s in seqs),
            "shared_blocks": sum(1 for r in pool.manager.ref if r > 1),
            "table_entries": sum(len(s.blocks) for s in seqs)}

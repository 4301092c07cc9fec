"""Tensor parallelism (lesson 18): one model split across processes, each holding a slice of every layer, their
partial results added by one all-reduce per block half (Megatron-LM's pattern), over torch.distributed's gloo
backend on loopback.

What it does: `check_split` refuses a world size that does not divide the key/value heads (attention is split
by key/value-head groups, so each rank keeps whole groups and a cache of its own heads only) and the feed-forward
width. `Shard.from_state` takes rank r's slice of a llama state dict: the query, key and value rows of its head
groups and the matching columns of the output projection; the gate and up rows of its share of the feed-forward
and the matching columns of the down projection; the embedding, the norms and the head whole on every rank.
`forward` runs a shard (the same code with one rank is the whole model), `run` spawns the ranks, reads a prompt,
decodes greedily and returns rank 0's logits, tokens, step seconds and the seconds spent in all-reduce.
What it does not do: split the head by vocabulary, overlap the all-reduce with compute, or listen anywhere but
127.0.0.1.
"""
from __future__ import annotations

import multiprocessing
import queue as queues
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..runtime import free_port
from .attention import apply_rotary, rms_norm, rotary_cos_sin


def check_split(config, world: int) -> None:
    """Refuse a world size the model cannot be split by, with the reason."""
    kv, ff = config.num_key_value_heads, config.intermediate_size
    if not isinstance(world, int) or isinstance(world, bool) or world < 1:
        raise ValueError(f"the world size is a whole number of processes >= 1, got {world!r}")
    if kv % world or ff % world:
        raise ValueError(f"tensor parallelism over {world} processes needs {world} to divide the {kv} key/value heads "
                         f"(attention is split by head groups) and the feed-forward's {ff} columns; choose one of "
                         f"{[w for w in range(1, kv + 1) if kv % w == 0 and ff % w == 0]}")


@dataclass
class ShardLayer:
    in_norm: torch.Tensor
    q: torch.Tensor  # (heads/world * D, hidden): this rank's query heads
    k: torch.Tensor  # (kv/world * D, hidden)
    v: torch.Tensor
    o: torch.Tensor  # (hidden, heads/world * D): the output projection's columns that read those heads
    post_norm: torch.Tensor
    gate: torch.Tensor  # (ff/world, hidden)
    up: torch.Tensor
    down: torch.Tensor  # (hidden, ff/world)


@dataclass
class Shard:
    rank: int
    world: int
    embed: torch.Tensor  # (V, hidden), whole on every rank (also the tied head)
    layers: list
    final_norm: torch.Tensor
    heads: int  # query heads on this rank
    kv_heads: int
    head_dim: int
    eps: float
    theta: float

    @classmethod
    def from_state(cls, state: dict, config, rank: int, world: int) -> "Shard":
        check_split(config, world)
        H, KV = config.num_attention_heads, config.num_key_value_heads
        D = getattr(config, "head_dim", None) or config.hidden_size // H
        h, kv, ff = H // world, KV // world, config.intermediate_size // world
        q_rows, kv_rows, ff_rows = (slice(rank * n, (rank + 1) * n) for n in (h * D, kv * D, ff))
        layers = []
        for i in range(config.num_hidden_layers):
            p = f"model.layers.{i}."
            w = lambda name: state[p + name].float()  # noqa: E731
            layers.append(ShardLayer(
                w("input_layernorm.weight"), w("self_attn.q_proj.weight")[q_rows].contiguous(),
                w("self_attn.k_proj.weight")[kv_rows].contiguous(), w("self_attn.v_proj.weight")[kv_rows].contiguous(),
                w("self_attn.o_proj.weight")[:, q_rows].contiguous(), w("post_attention_layernorm.weight"),
                w("mlp.gate_proj.weight")[ff_rows].contiguous(), w("mlp.up_proj.weight")[ff_rows].contiguous(),
                w("mlp.down_proj.weight")[:, ff_rows].contiguous()))
        theta = config.rope_parameters["rope_theta"] if getattr(config, "rope_parameters", None) else config.rope_theta
        return cls(rank, world, state["model.embed_tokens.weight"].float(), layers, state["model.norm.weight"].float(),
                   h, kv, D, config.rms_norm_eps, theta)

    def new_cache(self, capacity: int) -> list:
        """Keys and values of this rank's heads only, one (1, kv, capacity, D) pair per layer."""
        return [(torch.zeros(1, self.kv_heads, capacity, self.head_dim), torch.zeros(1, self.kv_heads, capacity, self.head_dim))
                for _ in self.layers]

    def bytes(self) -> int:
        """Bytes this rank holds: its slices and the whole embedding."""
        parts = [self.embed, self.final_norm] + [t for layer in self.layers for t in vars(layer).values()]
        return sum(t.numel() * t.element_size() for t in parts)


@torch.inference_mode()
def forward(shard: Shard, ids: torch.Tensor, cache: list, start: int, reduce) -> torch.Tensor:
    """(1, T) token IDs at positions start.. -> (1, T, V) logits. reduce(tensor) adds a partial result across the
    ranks in place (an all-reduce; nothing with one rank)."""
    T, D = ids.shape[1], shard.head_dim
    x = shard.embed[ids]  # (1, T, hidden)
    cos, sin = rotary_cos_sin(torch.arange(start, start + T), D, shard.theta)
    S = start + T
    mask = torch.ones(T, S, dtype=torch.bool).tril(diagonal=start)  # token t sees positions <= start + t
    group = shard.heads // shard.kv_heads
    for layer, (keys, values) in zip(shard.layers, cache):
        h = rms_norm(x, layer.in_norm, shard.eps)
        q = (h @ layer.q.T).view(1, T, shard.heads, D).transpose(1, 2)
        k = (h @ layer.k.T).view(1, T, shard.kv_heads, D).transpose(1, 2)
        v = (h @ layer.v.T).view(1, T, shard.kv_heads, D).transpose(1, 2)
        keys[:, :, start:S], values[:, :, start:S] = apply_rotary(k, cos, sin), v
        q = apply_rotary(q, cos, sin)
        k_all = keys[:, :, :S].repeat_interleave(group, dim=1)
        v_all = values[:, :, :S].repeat_interleave(group, dim=1)
        a = F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask)  # (1, h, T, D)
        o = a.transpose(1, 2).reshape(1, T, shard.heads * D) @ layer.o.T  # a partial sum over the heads
        reduce(o)
        x = x + o
        h = rms_norm(x, layer.post_norm, shard.eps)
        f = (F.silu(h @ layer.gate.T) * (h @ layer.up.T)) @ layer.down.T  # a partial sum over the columns
        reduce(f)
        x = x + f
    return rms_norm(x, shard.final_norm, shard.eps) @ shard.embed.T


def _rank(rank: int, world: int, port: int, state, config, prompt: list[int], steps: int, threads: int, out) -> None:
    """One process of the group: its shard, a prefill, then `steps` greedy decode steps, each timed between
    barriers. Rank 0 reports; any rank reports its error."""
    try:
        import torch.distributed as dist
        torch.set_num_threads(threads)
        if world > 1:
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        if state is None:  # the course's model, loaded here from the local cache
            from ..loading import load_model
            model, _ = load_model(device="cpu", verbose=False)
            state, config = model.state_dict(), model.config
        shard = Shard.from_state(state, config, rank, world)
        del state
        spent = [0.0]

        def reduce(t):
            if world > 1:
                began = time.perf_counter()
                dist.all_reduce(t)
                spent[0] += time.perf_counter() - began
        cache = shard.new_cache(len(prompt) + steps + 1)
        logits = forward(shard, torch.tensor([prompt]), cache, 0, reduce)[0, -1]
        first = logits.clone()
        tokens, seconds, reduced, position = [int(logits.argmax())], [], [], len(prompt)
        for _ in range(steps):
            if world > 1:
                dist.barrier()
            spent[0], began = 0.0, time.perf_counter()
            logits = forward(shard, torch.tensor([[tokens[-1]]]), cache, position, reduce)[0, -1]
            tokens.append(int(logits.argmax()))
            seconds.append(time.perf_counter() - began)
            reduced.append(spent[0])
            position += 1
        if rank == 0:
            # note: plain lists: a tensor would be shared through a file descriptor that dies with this process
            out.put({"logits": first.tolist(), "tokens": tokens, "step_s": seconds, "reduce_s": reduced,
                     "shard_bytes": shard.bytes()})
        if world > 1:
            dist.barrier()
            dist.destroy_process_group()
    except Exception as err:  # noqa: BLE001 - reported to the parent, which raises it with the rank
        out.put({"error": f"rank {rank}: {type(err).__name__}: {err}"})


def run(world: int, prompt: list[int], steps: int = 8, state: dict | None = None, config=None, threads: int = 1,
        timeout: float = 300) -> dict:
    """Spawn `world` processes on loopback, each with its shard (state: a llama state dict and its config; None:
    each process loads the course's model from the local cache), read `prompt`, decode `steps` greedy tokens.
    Returns rank 0's prefill logits (V,), tokens, seconds per step and seconds of all-reduce per step."""
    if config is not None:
        check_split(config, world)
    if not prompt:
        raise ValueError("the prompt needs at least one token")
    context = multiprocessing.get_context("spawn")
    out, port = context.Queue(), free_port()
    ranks = [context.Process(target=_rank, args=(r, world, port, state, config, list(prompt), steps, threads, out),
                             daemon=True) for r in range(world)]
    for p in ranks:
        p.start()
    try:
        deadline = time.time() + timeout
        while True:
            try:
                result = out.get(timeout=1.0)
                break
            except queues.Empty:
                dead = [r for r, p in enumerate(ranks) if p.exitcode not in (None, 0)]
                if dead or time.time() > deadline:
                    raise RuntimeError(f"tensor-parallel rank(s) {dead} died (exit codes "
                                       f"{[ranks[r].exitcode for r in dead]})" if dead else
                                       f"tensor-parallel run did not finish within {timeout:.0f} s")
        if "error" in result:
            raise RuntimeError(result["error"])
        result["logits"] = torch.tensor(result["logits"])
        return result
    finally:
        for p in ranks:
            p.join(timeout=30)
            if p.is_alive():
                p.terminate()

"""Checks for 18_beyond_one_machine: the bytes a prompt ships from prefill to decode, the tensor-parallel sizes a
model allows, the bandwidth a fleet's KV link carries, and a prediction of a shipment measured by shipping it."""
from __future__ import annotations

import struct
from types import SimpleNamespace

from ..runner.blocks import Sequence, blocks_for
from ..runner.paged import BlockPool
from ..runner.tensor_parallel import check_split
from ..serve import disagg, fleet_plan
from . import check_prediction, fresh, off, safely, verdict


def shipped_bytes(model, tokens: int, fmt: str) -> int:
    """The payload bytes disagg.pack really writes for `tokens` computed tokens of `model` in wire format `fmt`
    (the pool's contents do not change the size: zeros are shipped here)."""
    pool = BlockPool.for_model(model, blocks_for(tokens))
    seq = Sequence([0] * tokens)
    pool.grow(seq, tokens)
    seq.computed = tokens
    return _payload_bytes(disagg.pack(pool, seq, "check", 0, fmt))


def check_wire_bytes(wire_bytes, model) -> bool:
    """wire_bytes(tokens, fmt) -> the payload bytes a prompt of `tokens` tokens ships from the prefill process to the
    decode process in wire format fmt ("float32", "bfloat16" or "int8"), for this model (the course's Model). The
    check packs real blocks with serve/disagg.pack."""
    rng = fresh()
    for fmt in disagg.WIRE_FORMATS:
        tokens = rng.randint(1, 90)
        ok, got = safely(wire_bytes, tokens, fmt)
        if not ok:
            return verdict(False, "", got)
        want = shipped_bytes(model, tokens, fmt)
        if got != want:
            return verdict(False, "", f"for {tokens} tokens in {fmt} you said {got!r}: {off(got, want)}. Hint: every "
                           "layer ships keys and values, each token and key/value head a row of head_dim numbers; "
                           "the 8-bit format adds one float16 scale per row")
    return verdict(True, "keys and values of every layer, every key/value head, every prompt token: the bytes grow "
                   "with the prompt, never with the weights", "")


def allowed_sizes(kv_heads: int, ff: int) -> list[int]:
    """The world sizes runner/tensor_parallel.check_split accepts for a model of these shapes."""
    config = SimpleNamespace(num_key_value_heads=kv_heads, intermediate_size=ff)
    sizes = []
    for world in range(1, kv_heads + 1):
        try:
            check_split(config, world)
            sizes.append(world)
        except ValueError:
            pass
    return sizes


def check_tp_sizes(tp_sizes) -> bool:
    """tp_sizes(kv_heads, ff) -> every number of processes (ascending) the course's tensor parallelism can split
    a model with `kv_heads` key/value heads and a feed-forward `ff` wide into."""
    rng = fresh()
    cases = [(3, 1536), (8, 14336), (6, 1000)] + [(rng.choice([2, 4, 6, 8, 12]), rng.randint(300, 3000))
                                                 for _ in range(4)]
    for kv_heads, ff in cases:
        ok, got = safely(tp_sizes, kv_heads, ff)
        if not ok:
            return verdict(False, "", got)
        want = allowed_sizes(kv_heads, ff)
        if not isinstance(got, (list, tuple)) or list(got) != want:
            return verdict(False, "", f"for {kv_heads} key/value heads and a feed-forward {ff} wide you said {got!r}: "
                           "not the sizes the split accepts. Hint: each process keeps whole key/value heads and an "
                           "equal share of the feed-forward's columns")
    return verdict(True, "SmolLM2 splits over 1 or 3 processes only; Llama-3-70B's 8 key/value heads allow 1, 2, 4 or "
                   "8, which is why its tensor-parallel groups stop at one 8-GPU machine", "")


def check_kv_link(kv_link_gbs) -> bool:
    """kv_link_gbs(rate, prompt_tokens, kv_bytes_per_token) -> GB per second the link from prefill to decode machines
    carries when `rate` requests per second each ship their prompt's cache (compared with fleet_plan.plan)."""
    rng = fresh()
    for _ in range(4):
        rate, prompt = round(rng.uniform(0.5, 40), 2), rng.randint(100, 8000)
        work = fleet_plan.Workload(rate=rate, prompt_tokens=prompt, output_tokens=200, ttft_s=2.0, itl_s=0.05)
        want = fleet_plan.plan(fleet_plan.LLAMA_70B, fleet_plan.H100_SXM, work)["kv_link_gbs"]
        ok, got = safely(kv_link_gbs, rate, prompt, fleet_plan.LLAMA_70B.kv_bytes_per_token)
        if not ok:
            return verdict(False, "", got)
        if not isinstance(got, (int, float)) or isinstance(got, bool) or abs(got - want) > 1e-6 * want:
            return verdict(False, "", f"for {rate} requests per second of {prompt} prompt tokens you said {got!r}: "
                           f"{off(got, want)}. Hint: bytes per second = requests per second x tokens x bytes per "
                           "token; a GB is 1e9 bytes")
    return verdict(True, "every prompt's cache crosses the link once: the link scales with the rate and the prompt "
                   "length, and the calculator prints it beside the devices", "")


def check_shipped_prediction(prediction_mb, model, tokenizer, tokens: int = 2000, fmt: str = "bfloat16",
                             tolerance: float = 1.1) -> bool:
    """prediction_mb: your prediction, written BEFORE this runs, of the megabytes (1e6 bytes) the prefill process
    ships for a prompt of `tokens` tokens in wire format `fmt`. The check reads such a prompt into paged blocks with
    the model and packs them for the wire, as the prefill process does."""
    from ..text.context import filler_ids

    def measure():
        pool = BlockPool.for_model(model, blocks_for(tokens + 1))
        seq, first, _ = disagg.prefill_blocks(model, pool, filler_ids(tokenizer, tokens))
        frame = disagg.pack(pool, seq, "predict", first, fmt)
        return _payload_bytes(frame) / 1e6
    return check_prediction(prediction_mb, measure, unit="MB", what=f"shipped for {tokens:,} tokens in {fmt}",
                            tolerance=tolerance, hint="Section 2 printed the bytes per prompt token of each format: "
                                                      "multiply by the tokens, and mind which format")


def _payload_bytes(frame: bytes) -> int:
    """A frame's payload: what follows the magic, the header's length and the header (disagg.pack's layout)."""
    (header,) = struct.unpack("<Q", frame[len(disagg.MAGIC):len(disagg.MAGIC) + 8])
    return len(frame) - len(disagg.MAGIC) - 8 - header

"""A fleet on paper (lesson 18): how many accelerators a model needs for a request rate under latency targets,
from a roofline (bandwidth and FLOP/s, each at the fraction a real engine reaches) and the model's shapes.

What it does: `ModelShape`, `Device` and `Workload` hold the inputs (each printed by `plan`);
`plan` works out, step by step and in the open: the weights' and the KV cache's bytes; for each tensor-parallel
degree inside one machine (`replica`), the batch its memory holds beside the weights, a decode step's time at a
batch (weights and cache read once per step, plus two all-reduces per layer), the largest batch that keeps the time
between tokens under its target, and the replicas that carry the rate's tokens; the degree that needs the fewest
devices; a prompt's prefill time against the time-to-first-token
target, the prefill devices the rate needs, and the bytes per second a link carries when prefill and decode run on
different machines. `curve` sweeps the request rate.
What it does not do: measure anything (the lesson feeds it this machine's measured fraction of its bandwidth and
published figures for the accelerator), model queueing beyond utilisation, or price anything.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace


@dataclass(frozen=True)
class ModelShape:
    name: str
    params: float  # weights, all of them (a mixture of experts: see active_params)
    layers: int
    kv_heads: int
    head_dim: int
    weight_bytes: float = 2.0  # per parameter: 2 bfloat16, 1 fp8/int8, 0.5 int4
    kv_bytes: float = 2.0  # per cached number
    active_params: float | None = None  # per token, for a mixture of experts (None: all of them)

    @property
    def kv_bytes_per_token(self) -> float:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.kv_bytes  # keys and values

    @property
    def flops_per_token(self) -> float:
        return 2 * (self.active_params or self.params)


@dataclass(frozen=True)
class Device:
    name: str
    memory_gb: float
    bandwidth_gbs: float  # memory bandwidth, GB/s
    tflops: float  # dense bfloat16 peak
    link_gbs: float  # between the devices of one tensor-parallel group (NVLink), GB/s
    per_node: int = 8  # devices in one machine: a tensor-parallel group stays inside one


@dataclass(frozen=True)
class Workload:
    rate: float  # requests per second
    prompt_tokens: int
    output_tokens: int
    ttft_s: float  # target: time to first token
    itl_s: float  # target: time between tokens
    bandwidth_fraction: float = 0.7  # of the peak a decode step reaches (lessons 08 and 12 measure yours)
    flops_fraction: float = 0.5  # of the peak a prefill reaches
    memory_fraction: float = 0.9  # of a device's memory the server may use
    allreduce_s: float = 10e-6  # one small all-reduce inside a node (latency-bound at decode sizes)


def check_positive(**values) -> None:
    for name, value in values.items():
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0 or math.isinf(value):
            raise ValueError(f"{name} must be a positive number, got {value!r}")


def decode_step_s(model: ModelShape, device: Device, work: Workload, tp: int, batch: int) -> float:
    """One decode step of `batch` rows at the average context on a tensor-parallel group of `tp` devices: every
    device reads its share of the weights once and its share of every row's cache at the reached bandwidth, or
    computes its share of the rows' products at the reached FLOP/s, whichever takes longer (the roofline of
    lesson 08), and waits for two all-reduces per layer."""
    context = work.prompt_tokens + work.output_tokens / 2
    read = (model.params * model.weight_bytes + batch * context * model.kv_bytes_per_token) / tp
    compute = batch * model.flops_per_token / tp
    reduce = 2 * model.layers * work.allreduce_s if tp > 1 else 0.0
    return max(read / (device.bandwidth_gbs * 1e9 * work.bandwidth_fraction),
               compute / (device.tflops * 1e12 * work.flops_fraction)) + reduce


def largest_batch(model: ModelShape, device: Device, work: Workload, tp: int, limit: int = 1 << 20) -> int:
    """The largest batch whose decode step stays within the time-between-tokens target (0 if none does)."""
    low, high = 0, limit
    while low < high:
        mid = (low + high + 1) // 2
        if decode_step_s(model, device, work, tp, mid) <= work.itl_s:
            low = mid
        else:
            high = mid - 1
    return low


def replica(model: ModelShape, device: Device, work: Workload, tp: int) -> dict | None:
    """One decode replica of `tp` devices: the batch its memory holds, the batch its latency target allows, the
    smaller of the two, its step and tokens per second; None if it holds no request at all."""
    weights = model.params * model.weight_bytes
    per_request_kv = (work.prompt_tokens + work.output_tokens) * model.kv_bytes_per_token
    room = tp * device.memory_gb * 1e9 * work.memory_fraction - weights  # besides the weights: the KV cache
    if room <= per_request_kv:
        return None
    memory_batch = int(room // per_request_kv)
    latency_batch = largest_batch(model, device, work, tp)
    batch = min(memory_batch, latency_batch)
    if batch < 1:
        return None
    step = decode_step_s(model, device, work, tp, batch)
    replicas = math.ceil(work.rate * work.output_tokens / (batch / step))
    return {"tp": tp, "batch_by_memory": memory_batch, "batch_by_latency": latency_batch, "batch": batch,
            "binding": "memory" if memory_batch < latency_batch else "latency", "decode_step_ms": 1000 * step,
            "tokens_per_s_per_replica": batch / step, "decode_replicas": replicas, "decode_devices": replicas * tp}


def plan(model: ModelShape, device: Device, work: Workload) -> dict:
    """Every figure of the fleet, with the inputs it came from: each tensor-parallel degree inside one machine
    (`options`), and the one that needs the fewest decode devices. Raises ValueError when no group inside one
    machine meets the targets (and says what to change)."""
    check_positive(rate=work.rate, prompt_tokens=work.prompt_tokens, output_tokens=work.output_tokens,
                   ttft_s=work.ttft_s, itl_s=work.itl_s, memory_gb=device.memory_gb, bandwidth=device.bandwidth_gbs)
    weights = model.params * model.weight_bytes
    degrees = [d for d in (1, 2, 4, 8, 16) if d <= device.per_node and model.kv_heads % d == 0]
    options = [o for o in (replica(model, device, work, tp) for tp in degrees) if o is not None]
    if not options:
        raise ValueError(f"no tensor-parallel group of up to {device.per_node} {device.name} devices holds "
                         f"{model.name}'s {weights / 1e9:.0f} GB of weights with room for a request's cache and "
                         f"a step under {work.itl_s * 1000:.0f} ms: lower the precision, relax the target, or split "
                         "the layers across machines (pipeline parallelism)")
    best = min(options, key=lambda o: (o["decode_devices"], o["tp"]))
    prefill_flops = model.flops_per_token * work.prompt_tokens
    prefill_s = prefill_flops / (best["tp"] * device.tflops * 1e12 * work.flops_fraction)
    prefill_devices = math.ceil(work.rate * prefill_flops / (device.tflops * 1e12 * work.flops_fraction))
    return {
        "inputs": {"model": asdict(model), "device": asdict(device), "workload": asdict(work)},
        "weights_gb": weights / 1e9, "kv_mb_per_token": model.kv_bytes_per_token / 1e6,
        "kv_gb_per_request": (work.prompt_tokens + work.output_tokens) * model.kv_bytes_per_token / 1e9,
        "options": options, **best, "weights_gb_per_device": weights / best["tp"] / 1e9,
        "prefill_s": prefill_s, "ttft_met": prefill_s <= work.ttft_s, "prefill_devices": prefill_devices,
        "devices": best["decode_devices"] + prefill_devices,
        "kv_link_gbs": work.rate * work.prompt_tokens * model.kv_bytes_per_token / 1e9,
    }


def curve(model: ModelShape, device: Device, work: Workload, rates: list[float]) -> list[dict]:
    """plan() at each request rate (the other inputs unchanged)."""
    return [plan(model, device, replace(work, rate=r)) for r in rates]


# Published shapes and figures (the lesson prints them; check them against the vendor's sheet before relying on them)
LLAMA_70B = ModelShape("Llama-3-70B", 70.6e9, 80, 8, 128)  # 8 key/value heads of 128, 80 layers (its config.json)
H100_SXM = Device("H100 SXM", 80, 3350, 989, 450)  # 80 GB HBM3, 3.35 TB/s, 989 TFLOP/s dense bf16, NVLink 900 GB/s both ways

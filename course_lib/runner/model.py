"""The llama model written out in plain torch, on the course's real weights (Part II, lesson 11).

What it does: builds SmolLM2 from the weights the course already has (a loaded transformers model,
or the cached safetensors folder): token embedding, RMSNorm, rotary positions, grouped-query
attention (9 query heads sharing 3 key/value heads), the SwiGLU feed-forward and the output head
tied to the embedding. Each part is a function a lesson can call alone (`embed`, `norm`,
`attention`, `feed_forward`, `block`, `head`). The model reads and writes the course's own
preallocated cache (`kv_cache.KVCache`) and meets the loop's contract: it is called like a
transformers model (`input_ids`, `attention_mask`, `position_ids`, `cache`, `logits_to_keep`) and
returns `.logits (B, T_keep, V)` and `.cache`, so `stages.prefill` / `decode_step` run it as they
run the library's model. Every matrix product goes through one `Linear` object (its matrix stored by
rows or by columns, whichever this machine reads faster: layout.py), so a weight format (lesson 12) is
a different linear layer, not a second model.
What it does not do: train, or load any architecture other than llama-style decoders.
"""
from __future__ import annotations

import copy

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from .attention import apply_rotary, rotary_cos_sin
from .kv_cache import KVCache, head_dim_of
from .layout import SEVERAL_ROWS, arrange, layout_of, onednn_linear, several_rows_kernel


class Linear:
    """y = x @ W.T with W (out, in), stored the way this machine reads fastest (`layout`: auto, rows or
    columns; see layout.fastest_layout). Two to SEVERAL_ROWS rows at once may go to another kernel (`kernel`:
    auto, mkl or onednn; see layout.several_rows_kernel). The float path; lesson 12's formats replace it."""
    format = "float"

    def __init__(self, weight: torch.Tensor, layout: str = "auto", kernel: str = "auto"):
        self.weight = arrange(weight, layout)  # (out, in), by rows or by columns
        self.kernel = several_rows_kernel(self.weight, kernel)  # for 2..SEVERAL_ROWS rows; others: F.linear

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        # note: under torch.compile the compiler picks the product's kernel itself (and a symbolic row count
        # cannot go to oneDNN's operator called by name)
        if 1 < rows <= SEVERAL_ROWS and self.kernel == "onednn" and not torch.compiler.is_compiling():
            return onednn_linear(x.reshape(rows, x.shape[-1]), self.weight).reshape(*x.shape[:-1], self.weight.shape[0])
        return F.linear(x, self.weight)  # note: by columns, this is the plain x @ M with M (in, out) row-major

    @property
    def layout(self) -> str:
        return layout_of(self.weight)

    @property
    def nbytes(self) -> int:
        return self.weight.numel() * self.weight.element_size()

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]


@dataclass
class Layer:
    """One decoder block's weights: two norms, fused q|k|v, output projection, fused gate|up, down."""
    attn_norm: torch.Tensor  # (hidden,)
    qkv: Linear  # (H*D + 2*KV*D, hidden)
    o: Linear  # (hidden, H*D)
    mlp_norm: torch.Tensor  # (hidden,)
    gate_up: Linear  # (2*intermediate, hidden)
    down: Linear  # (hidden, intermediate)


@dataclass
class Output:
    logits: torch.Tensor  # (B, T_keep, V)
    cache: KVCache | None


def embed(model: "Model", input_ids: torch.Tensor) -> torch.Tensor:
    """Token IDs (B, T) to vectors (B, T, hidden): one row of the embedding matrix per token."""
    return F.embedding(input_ids, model.embedding)


def norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm (attention.rms_norm written out), through torch's F.rms_norm: one call from Python instead of
    seven (on the CPU, torch 2.13 still runs it as several operators underneath; the profiler counts them).
    In float32 its numbers are the very same; in bfloat16 it rounds once less than the library's version
    (within one bfloat16 step, about 0.4%: tests/test_model.py bounds the effect on logits)."""
    return F.rms_norm(x, weight.shape, weight, eps)


def attention(model: "Model", layer: Layer, index: int, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
              cache: KVCache | None, start: int, mask: torch.Tensor | None) -> torch.Tensor:
    """Grouped-query attention of one layer. h: (B, T, hidden) normed input; cos/sin: (B, 1, T, D);
    writes this step's keys and values into the cache at columns [start, start + T) and attends over
    every column up to there. mask: None (causal over all columns) or (B, 1, T, S) bool, True = may look."""
    B, T, _ = h.shape
    H, KV, D = model.heads, model.kv_heads, model.head_dim
    qkv = layer.qkv(h).view(B, T, H + 2 * KV, D).transpose(1, 2)  # (B, H + 2 KV, T, D): q heads, k heads, v heads
    qk = apply_rotary(qkv[:, :H + KV], cos, sin)  # note: queries and keys turned in one go (fewer operators)
    q, k, v = qk[:, :H], qk[:, H:], qkv[:, H + KV:]  # (B, H, T, D), (B, KV, T, D), (B, KV, T, D)
    if getattr(cache, "reads_in_place", False):  # a paged decode step: attention walks the block tables (lesson 16)
        return layer.o(cache.attend(index, q, k, v).transpose(1, 2).reshape(B, T, H * D))
    if cache is not None:
        k, v = cache.write(index, k, v, start)  # (B, KV, S, D) with S = start + T: the past and this step
    G = H // KV
    if mask is None and T > 1 and start == 0:
        # a plain prompt: the fused causal kernel; each key/value head is repeated for its G query heads
        out = F.scaled_dot_product_attention(q, k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1),
                                             is_causal=True)  # (B, H, T, D)
        return layer.o(out.transpose(1, 2).reshape(B, T, H * D))
    # subtle: for a few new tokens against a cache, instead of copying each key/value head G times, fold the
    # G query heads that share it into the query axis: (B, KV, G*T, D). Same result; the cache is read once.
    q = q.reshape(B, KV, G * T, D)
    if mask is None and T > 1:
        mask = causal_mask(B, T, k.shape[2], start, q.device)
    if mask is not None:
        mask = mask.unsqueeze(2).expand(B, 1, G, T, mask.shape[-1]).reshape(B, 1, G * T, mask.shape[-1])
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # (B, KV, G*T, D)
    out = out.reshape(B, H, T, D).transpose(1, 2).reshape(B, T, H * D)  # (B, T, H*D)
    return layer.o(out)  # (B, T, hidden)


def causal_mask(B: int, T: int, S: int, start: int, device, key_mask: torch.Tensor | None = None) -> torch.Tensor:
    """(B, 1, T, S) bool: query i (at column start + i) may look at key j if j <= start + i and key j is
    real (key_mask (B, S), 1 = token, 0 = padding). A query always sees itself, so a padding row never
    attends to nothing (that would give NaN)."""
    j = torch.arange(S, device=device)
    i = torch.arange(T, device=device)[:, None] + start
    allowed = (j[None, :] <= i)[None, None]  # (1, 1, T, S)
    if key_mask is not None:
        allowed = allowed & key_mask.bool()[:, None, None, :]
        allowed = allowed | (j[None, :] == i)[None, None]
    return allowed.expand(B, 1, T, S)


@torch.inference_mode()
def layer_qkv(model: "Model", input_ids, index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The queries, keys and values layer `index` computes on one prompt (rotary positions applied), as its
    attention receives them: q (1, H, T, D), k and v (1, KV, T, D). The blocks before it run as in the model."""
    ids = torch.as_tensor(input_ids, dtype=torch.long, device=model.device).reshape(1, -1)
    T = ids.shape[1]
    cos, sin = model.cos[:T].to(model.dtype)[None, None], model.sin[:T].to(model.dtype)[None, None]
    x = embed(model, ids)
    for i in range(index):
        x = block(model, i, x, cos, sin, None, 0, None)
    layer, H, KV, D = model.layers[index], model.heads, model.kv_heads, model.head_dim
    qkv = layer.qkv(norm(x, layer.attn_norm, model.eps)).view(1, T, H + 2 * KV, D).transpose(1, 2)
    qk = apply_rotary(qkv[:, :H + KV], cos, sin)
    return qk[:, :H], qk[:, H:], qkv[:, H + KV:]


def feed_forward(layer: Layer, h: torch.Tensor) -> torch.Tensor:
    """SwiGLU: down(silu(gate(h)) * up(h)). h: (B, T, hidden) -> (B, T, hidden)."""
    gate, up = layer.gate_up(h).chunk(2, dim=-1)  # (B, T, intermediate) each
    return layer.down(F.silu(gate) * up)


def block(model: "Model", index: int, x: torch.Tensor, cos, sin, cache, start: int, mask) -> torch.Tensor:
    """One decoder block: x + attention(norm(x)), then + feed_forward(norm(.)). x: (B, T, hidden)."""
    layer = model.layers[index]
    x = x + attention(model, layer, index, norm(x, layer.attn_norm, model.eps), cos, sin, cache, start, mask)
    return x + feed_forward(layer, norm(x, layer.mlp_norm, model.eps))


def head(model: "Model", x: torch.Tensor) -> torch.Tensor:
    """Final norm, then the output head (the embedding matrix again: tied weights). (B, T, hidden) -> (B, T, V)."""
    return model.lm_head(norm(x, model.final_norm, model.eps))


class Model:
    """SmolLM2 written out. Call it like the library's model; `new_cache` makes its preallocated cache.
    Example: ours = Model.from_transformers(model); ours(input_ids=ids, cache=ours.new_cache(1, 64)).logits"""

    def __init__(self, state: dict[str, torch.Tensor], config, generation_config=None, layout: str = "auto",
                 kernel: str = "auto"):
        self.config, self.generation_config = config, generation_config
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim, self.eps = head_dim_of(config), config.rms_norm_eps
        # note: with tied weights a file may keep either name; the embedding and the head are one tensor
        self.embedding = state.get("model.embed_tokens.weight", state.get("lm_head.weight"))  # (V, hidden)
        tied = getattr(config, "tie_word_embeddings", True) or "lm_head.weight" not in state
        self.final_norm = state["model.norm.weight"]
        linear = lambda weight: Linear(weight, layout, kernel)  # noqa: E731
        self.lm_head = linear(self.embedding if tied else state["lm_head.weight"])
        if tied:  # the lookup reads the head's own tensor, whichever layout it was given (one copy, not two)
            self.embedding = self.lm_head.weight
        self.layers = []
        for i in range(config.num_hidden_layers):
            p = lambda name: state[f"model.layers.{i}.{name}.weight"]  # noqa: E731
            self.layers.append(Layer(
                p("input_layernorm"),
                linear(torch.cat([p("self_attn.q_proj"), p("self_attn.k_proj"), p("self_attn.v_proj")])),
                linear(p("self_attn.o_proj")), p("post_attention_layernorm"),
                linear(torch.cat([p("mlp.gate_proj"), p("mlp.up_proj")])), linear(p("mlp.down_proj"))))
        positions = torch.arange(config.max_position_embeddings, device=self.embedding.device)
        theta = config.rope_parameters["rope_theta"] if getattr(config, "rope_parameters", None) else config.rope_theta
        self.cos, self.sin = rotary_cos_sin(positions, self.head_dim, theta)  # (window, D) each, float32

    # ----- construction -----
    @classmethod
    def from_transformers(cls, hf_model, dtype: torch.dtype | None = None, layout: str = "auto",
                          kernel: str = "auto") -> "Model":
        """Our model on the library model's own weights (its device; its dtype unless `dtype` is given).
        layout: how the matrices are stored ("auto": the faster of rows and columns here, layout.fastest_layout);
        kernel: what multiplies two or more rows ("auto", "mkl", "onednn": layout.several_rows_kernel)."""
        state = {name: t.detach() for name, t in hf_model.state_dict().items()}
        if dtype is not None:
            state = {name: t.to(dtype) for name, t in state.items()}
        return cls(state, hf_model.config, getattr(hf_model, "generation_config", None), layout, kernel)

    @classmethod
    def from_folder(cls, folder: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> "Model":
        """Our model straight from a safetensors folder (the course's weight cache), no transformers model built."""
        from safetensors.torch import load_file
        from transformers import AutoConfig, GenerationConfig
        folder = Path(folder)
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no .safetensors file in {folder}: run `make setup` to build the weight cache")
        state = {}
        for f in files:
            state.update(load_file(str(f), device=str(device)))
        state = {name: t.to(dtype) for name, t in state.items()}
        config = AutoConfig.from_pretrained(folder, local_files_only=True)
        generation = GenerationConfig.from_pretrained(folder, local_files_only=True) \
            if (folder / "generation_config.json").exists() else None
        return cls(state, config, generation)

    def with_parts(self, **parts) -> "Model":
        """A new model that shares this one's tensors except the parts given (embedding, final_norm, lm_head, layers,
        config, format): how a weight format (formats.convert) or a shorter drafter (speculative.early_exit) is built
        from a model, without reaching into it from outside. Example: ours.with_parts(layers=ours.layers[:8])"""
        unknown = sorted(set(parts) - {"embedding", "final_norm", "lm_head", "layers", "config", "format"})
        if unknown:
            raise ValueError(f"a model's replaceable parts are embedding, final_norm, lm_head, layers, config and "
                             f"format; got {unknown}")
        out = copy.copy(self)
        for name, value in parts.items():
            setattr(out, name, value)
        return out

    # ----- what the loop needs -----
    @property
    def device(self) -> torch.device:
        return self.embedding.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embedding.dtype

    def new_cache(self, batch: int, capacity: int) -> KVCache:
        """An empty preallocated cache for `batch` rows of up to `capacity` tokens (it grows if needed)."""
        return KVCache(self.config.num_hidden_layers, batch, self.kv_heads, self.head_dim,
                       min(capacity, self.config.max_position_embeddings), self.dtype, self.device)

    @torch.inference_mode()
    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                 position_ids: torch.Tensor | None = None, cache: KVCache | None = None, use_cache: bool = True,
                 logits_to_keep: int = 0) -> Output:
        """input_ids (B, T); attention_mask (B, S) over the cache and these tokens (1 = token, 0 = padding);
        position_ids (B, T). logits_to_keep: how many last positions get logits (0 = all)."""
        B, T = input_ids.shape
        start = cache.length if cache is not None else 0
        if start + T > self.config.max_position_embeddings:
            raise ValueError(f"{start + T} tokens do not fit the context window of {self.config.max_position_embeddings}")
        if cache is not None:
            cache.reserve(start + T)
        if position_ids is None:
            position_ids = torch.arange(start, start + T, device=input_ids.device).expand(B, T)  # (B, T)
        if self.cos.dtype != self.dtype:  # note: tables in the activations' dtype, converted once
            self.cos, self.sin = self.cos.to(self.dtype), self.sin.to(self.dtype)
        cos = self.cos[position_ids].unsqueeze(1)  # (B, 1, T, D)
        sin = self.sin[position_ids].unsqueeze(1)
        mask = None
        if attention_mask is not None and not bool(attention_mask.all()):
            mask = causal_mask(B, T, start + T, start, input_ids.device, attention_mask[:, -(start + T):])
        x = embed(self, input_ids)  # (B, T, hidden)
        for index in range(len(self.layers)):
            x = block(self, index, x, cos, sin, cache, start, mask)
        if cache is not None:
            cache.length = start + T
        keep = T if logits_to_keep in (0, None) else min(logits_to_keep, T)
        return Output(head(self, x[:, T - keep:]), cache)  # note: the head only where logits are wanted

    def linears(self) -> list:
        """Every matrix product of a decode step, in the order it runs: each layer's four, then the head."""
        return [m for layer in self.layers for m in (layer.qkv, layer.o, layer.gate_up, layer.down)] + [self.lm_head]

    def weight_bytes(self) -> int:
        """Bytes every decode step reads: all matrices once (the tied head counted: it is read again) and norms."""
        linears = self.linears()
        norms = [self.final_norm] + [t for layer in self.layers for t in (layer.attn_norm, layer.mlp_norm)]
        return sum(m.nbytes for m in linears) + sum(t.numel() * t.element_size() for t in norms)


def load(folder: str | Path | None = None, device: str | None = None, dtype: torch.dtype = torch.float32) -> Model:
    """The course's model written out, from the weight cache `make setup` built. Example: ours = load()"""
    from ..loading import ModelNotFoundError, cache_is_built, weights_cache_dir, FIX
    from ..runtime import resolve_device
    if folder is None:
        if not cache_is_built():
            raise ModelNotFoundError(f"the course model is not set up yet: {FIX}")
        folder = weights_cache_dir()
    return Model.from_folder(folder, resolve_device(device), dtype)


def parameter_count(model: Model) -> int:
    """Distinct parameters (the tied head counted once). Example: SmolLM2-135M -> 134,515,008"""
    tensors = [model.embedding, model.final_norm] + [t for layer in model.layers for t in
                                                     (layer.attn_norm, layer.mlp_norm, layer.qkv.weight, layer.o.weight,
                                                      layer.gate_up.weight, layer.down.weight)]
    return sum(t.numel() for t in tensors)



@torch.inference_mode()
def library_parts(hf_model, input_ids) -> dict[str, torch.Tensor]:
    """What the library computes at each stage for one prompt, caught with forward hooks, to check ours
    against piece by piece: embedding, layer 0's input norm, attention and block output, the last
    block's output (the stack, before the final norm) and the logits. Each (T, ...) for the one row."""
    inner, seen, handles = hf_model.model, {}, []
    first = lambda out: out[0] if isinstance(out, tuple) else out  # noqa: E731
    spots = {"embedding": inner.embed_tokens, "norm0": inner.layers[0].input_layernorm,
             "attention0": inner.layers[0].self_attn, "block0": inner.layers[0], "stack": inner.layers[-1]}
    for name, module in spots.items():
        handles.append(module.register_forward_hook(lambda m, a, out, name=name: seen.__setitem__(name, first(out)[0])))
    try:
        ids = torch.as_tensor(input_ids, device=hf_model.device).reshape(1, -1)
        seen["logits"] = hf_model(input_ids=ids).logits[0]
    finally:
        for h in handles:
            h.remove()
    return seen

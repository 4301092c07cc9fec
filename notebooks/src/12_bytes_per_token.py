# %% [markdown]
# # 12 · Bytes per token: weight formats, speed, and what quality each costs
#
# **Goal.** Lesson 08 showed that a decode step reads every weight once. Here we act on it: store the
# same weights in fewer bytes, watch the time per token follow the bytes, and measure what the answer
# loses, on the model of lesson 11.
#
# **You will**
# - tell apart three numbers: the file on disk, the model in memory, the bytes read per token;
# - run the same model in six weight formats, from float32 down to the file's own 4 bits, and put their
#   speed on a roofline measured on this machine;
# - read the model file's raw bytes and check that every 4-bit weight the course runs is the file's own;
# - measure quality on real text (perplexity), and separately the distance to the file's model, and find
#   which parts of the model break first when rounded further than the file did.

# %% [markdown]
# ## Set-up
#
# One thread, set explicitly: a fixed thread count makes the formats comparable, and two threads on a busy
# 2-core machine can get in each other's way (the committed peers record in section 7 has both counts). (`python -m course_lib bench --only formats
# --threads N` measures any count.)

# %%
import matplotlib.pyplot as plt
import torch
import course_lib
from course_lib.runner import formats
from course_lib.views import plots_perf, plots_roofline
from course_lib.text.context import chat_ids, story_ids
from course_lib.measure.race import our_step_seconds, generate_exact
from course_lib.measure.memory import kernel_bandwidth, read_bandwidth
from course_lib.measure.quality import agreement, bits_per_weight, perplexity, requantized, SCHEMES
from course_lib.engine.generation import generate
from course_lib.engine.stages import prefill
from course_lib.loading import GGUF_BYTES
from course_lib.runner.model import Model
from course_lib.runtime import cpu_bfloat16, cpu_lesson, progress, time_it

torch.set_num_threads(1)
device = cpu_lesson("torch's 4-bit kernel here is a CPU kernel, and every format starts from the float32 model")
model, tokenizer = course_lib.load_model(device=device, dtype="float32")
ours = Model.from_transformers(model)  # float32, lesson 11
models = {name: formats.convert(ours, name) for name in formats.FORMATS}
print("threads:", torch.get_num_threads(), "| formats:", ", ".join(models))

# %% [markdown]
# ## 1. Three numbers that are easy to mix up
#
# The file the course downloaded stores most weights in 4 bits. Set-up expanded it to float32, which is
# what lessons 00-11 ran. And a decode step reads every matrix once: the attention and feed-forward
# matrices, and the output head, which is the embedding matrix again (tied), read in full for every token.

# %%
params = sum(p.numel() * p.element_size() for p in model.parameters())
print(f"file on disk (GGUF, 4-bit layers, 8-bit embedding): {GGUF_BYTES / 1e6:6.1f} MB")
print(f"model in memory (float32 parameters):             {params / 1e6:6.1f} MB")
print(f"\n{'format':<13} {'activations':<12} {'layers':<10} {'head':<10} {'read per token':>15} {'in memory':>10}")
for name, m in models.items():
    dtype, layers_kind, head_kind = formats.FORMATS[name]
    # note: a quantized head is a second copy of the tied embedding, which the lookup keeps in the activations' dtype
    lookup = m.embedding.numel() * m.embedding.element_size() if head_kind != "float" else 0
    print(f"{name:<13} {str(dtype).split('.')[-1]:<12} {layers_kind:<10} {head_kind:<10} "
          f"{m.weight_bytes() / 1e6:12.1f} MB {(m.weight_bytes() + lookup) / 1e6:7.1f} MB")

# %% [markdown]
# `int4-float32` reads more than `int4`: it keeps the head in float32 so that its numbers are exactly the
# course model's (section 5). `int4` stores the head in 8 bits, as the file itself does. Read its head column:
# `int8-dynamic` (which also rounds the head's input: section 7 says why) where oneDNN's integer product is exact
# on this CPU, the weight-only `int8` where it is missing or saturates (a CPU without VNNI instructions adds the
# products in pairs into 16-bit sums: `formats.int8_dynamic_available` tries exactly that case).
#
# ## 2. The 4-bit weights are the file's own blocks
#
# The file stores each layer matrix as Q4_1: blocks of 32 weights, each block 20 bytes: a float16 scale, a
# float16 minimum, then 16 bytes holding two 4-bit numbers `q` (0..15) each, the weight being
# `q * scale + minimum`. The embedding (which is also the output head) is Q8_0: blocks of 32 signed bytes with
# one float16 scale. Here is the first block of layer 0's `down` matrix, byte by byte, read from the file:

# %%
from course_lib.measure import gguf_file, peers_llama

raw = gguf_file.raw_block("blk.0.ffn_down.weight", row=0, block=0)
print(f"{raw['type']} block, {len(raw['bytes'])} bytes:", raw["bytes"].hex(" "))
print(f"bytes 0-1 (float16 scale):   {raw['scale']:.6f}")
print(f"bytes 2-3 (float16 minimum): {raw['minimum']:.6f}")
print("bytes 4-19, low nibbles then high nibbles, q =", raw["q"])
w = ours.layers[0].down.weight  # (576, 1536): the course's float32 weights
print("q * scale + minimum, first 4:", [round(x, 6) for x in raw["weights"][:4]])
print("the course's float32 weights: ", [round(float(x), 6) for x in w[0, :4]])

# %% [markdown]
# The course's "float32 model" is these numbers written out in 32 bits. Quantizing a float32 block again by
# the file's rule (its minimum and maximum, 16 levels between) gives the same `q`, scale and minimum back.
# The next cell checks that for every 4-bit tensor in the file, and the 8-bit embedding's values too
# (the query and key matrices are stored with their rows reordered by llama.cpp's converter; the check
# applies the same order):

# %%
report = gguf_file.check_against_file(model)
q41 = [r for r in report if r["type"] == "Q4_1"]
print(f"{len(q41)} Q4_1 tensors: {sum(r['same_blocks'] for r in q41)} give back the file's blocks exactly, "
      f"{sum(r['q_mismatches'] for r in q41)} 4-bit numbers differ in all")
print(f"largest |file value - course weight| over {len(report)} tensors "
      f"(the Q8_0 embedding included): {max(r['max_diff'] for r in report)}")
q, scale, low = formats.quantize_int4(w)
print("layer 0's down, requantized, first block's q:", q[0, :32].tolist())

# %% [markdown]
# So `int4-float32` loses nothing against the course's float32 weights (only the float rounding of the
# activations differs). `int4` keeps the file's 4-bit codes too, with two more roundings on top: torch's kernel
# wants each block's scale and minimum in the activations' dtype, so they are re-stored in bfloat16 (8
# significant bits against float16's 11), and its head is re-quantized from the file's Q8_0 blocks to int8 with
# one scale per row; the head's input is rounded to 8 bits too, row by row, at every call (dynamic quantization:
# the weights' int8 then meet it in integer arithmetic). And float32 is not a higher-precision original: no such copy of SmolLM2 is installed
# here. That changes how quality has to be measured (section 5).
#
# ## 3. A trap first: int8 that is slower than float32
#
# The obvious int8: store int8 weights, cast them back to float, multiply. Each cast writes a whole float
# matrix, so more bytes move than with float weights. Torch's fused weight-only kernel reads the int8
# bytes and multiplies in one pass.

# %%
prompt = story_ids(tokenizer)
median = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731 - robust to one slow step
step_ms, step_runs = {}, {}  # the median step of each format, and every step behind it (ms)
for name in ["float32", "int8-cast", "int8"]:
    our_step_seconds(models[name], tokenizer, prompt, 2)  # warm-up
    step_runs[name] = [1000 * s for s in our_step_seconds(models[name], tokenizer, prompt, 12)]
    step_ms[name] = median(step_runs[name])
    fastest, slowest = min(step_runs[name]), max(step_runs[name])
    print(f"{name:<10} {step_ms[name]:6.1f} ms per decode step (steps {fastest:.1f}-{slowest:.1f})")

# %% [markdown]
# ## 4. Every format on a roofline
#
# The ceiling is this machine's streaming read rate, measured the way decode reads: a sum over a buffer far
# larger than the caches (1 GiB, or twice the largest cache the CPU reports). If reading were the only
# cost, a format's step would take its bytes divided by that rate: the dashed line.

# %%
for name in ["bfloat16", "int4-float32", "int4", "int4-q8"]:
    our_step_seconds(models[name], tokenizer, prompt, 2)
    step_runs[name] = [1000 * s for s in our_step_seconds(models[name], tokenizer, prompt, 12)]
    step_ms[name] = median(step_runs[name])
read_bw = read_bandwidth()
names = list(models)
print(f"streaming read: {read_bw / 1e9:.1f} GB/s")
for name in names:
    b = models[name].weight_bytes()
    print(f"{name:<13} {b / 1e6:6.1f} MB  {step_ms[name]:6.1f} ms  {1000 / step_ms[name]:5.1f} tok/s  "
          f"reads at {b / step_ms[name] / 1e6:5.1f} GB/s")
plots_roofline.plot_decode_bytes(names, [models[n].weight_bytes() for n in names], [step_ms[n] for n in names], read_bw,
                                 spread=[(min(step_runs[n]), max(step_runs[n])) for n in names])
plt.show()

# %% [markdown]
# Points near the line are bound by memory; points far above it are bound by something else: the
# kernel itself. The extreme case is `int4-float32`: the same 4-bit bytes as `int4`, but torch's 4-bit CPU
# kernel is built for bfloat16 activations, and with float32 ones it takes many times longer per row (the
# table printed both); `int4` exists because of it. Each kernel has its own rate on this model's shapes: 256 MB of copies of the four shapes,
# called in turn after the caches were flushed, as a decode step calls its layers:

# %%
shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # q|k|v, o, gate|up, down
for name in ["float32", "bfloat16", "int8", "int4"]:
    print(f"{name:<9} kernel reads {kernel_bandwidth(name, shapes) / 1e9:5.1f} GB/s")

# %% [markdown]
# The kernel's rate matters as much as the bytes. Our float32 model keeps some matrices by columns, the
# order its kernel streams fastest on this machine (lesson 11, section 8), while bfloat16's kernel showed
# no such gain here and keeps them by rows. So in the runs made for this lesson, at one thread, float32
# decoded about as fast as bfloat16 (sometimes faster) while reading twice the bytes. Half the bytes
# pays only through a kernel that reads them at a comparable rate; the table above says whether yours does.
#
# ## 5. What the answer loses
#
# Two different questions, with two different measurements.
#
# **How good is each format's model?** Perplexity on real text (lower is better): the first 512 tokens of
# *Pride and Prejudice*, which the course ships (`data/long/`). It needs no reference model.

# %%
from course_lib.engine.long_context import long_text_ids

text_ids = long_text_ids(tokenizer, 512)
ppl = {}
for n in ["float32", "bfloat16", "int8", "int4", "int4-q8"]:
    ppl[n] = perplexity(models[n], text_ids)
    print(f"{n:<9} perplexity {ppl[n]:6.3f} on {len(text_ids)} tokens   ({ppl[n] / ppl['float32'] - 1:+.2%} against float32)")

# %% [markdown]
# A fraction of a percent on 512 tokens is not a ranking: rounding the activations differently moves the
# perplexity a little either way (a format can even come out below float32, as the lines above may show).
# A format that damaged the model would move it by whole percents, as the last part of this section shows.
#
# **How far is each format from the file's model?** Teacher forcing on the running examples: every format
# reads float32's greedy answers, and we count how often its top token agrees with float32's and the KL
# divergence of its next-token distribution from float32's. Since float32 *is* the file's 4-bit model,
# this measures distance to the file, not loss of quality: `int4` reproduces the file's blocks and lands
# near zero by construction, while `int8` rounds the file's 4-bit values again onto a grid of its own
# (one scale per row: finer steps than the file's, but not aligned with them) and moves away. On a model whose
# original weights we had, int8's finer step would usually make it the closer of the two; here this table
# cannot say so, and must not be read that way.

# %%
questions = ["What is the capital of France?", "What is the capital gains tax in France?",
             "The bank is closed because they had no money left."]
prompts = [chat_ids(tokenizer, q, system="You are a helpful assistant.") for q in questions]
sequences = [p + generate_exact(ours, tokenizer, p, 24) for p in prompts]
quality = {n: agreement(ours, models[n], sequences, [len(p) - 1 for p in prompts]) for n in names}
for n, qd in quality.items():
    print(f"distance to the file's model, {n:<13} top-1 agreement {qd['top1_agreement']:.3f}   "
          f"KL {qd['kl']:.5f} nats   ({qd['positions']} positions)")
for n in ["float32", "int8", "int4"]:
    print(f"{n:<8} answers {generate(models[n], tokenizer, prompts[0], 16).text!r}")

# %% [markdown]
# Where does int4's small distance come from? It changes three things at once: activations in bfloat16, the
# 4-bit layers' scales rounded to bfloat16, and an int8 head (whose input is rounded to 8 bits too, where oneDNN's
# integer product is exact here: the table's head column says which). Swapping one part
# at a time splits it (the same positions; each line differs from the one above it in one part):

# %%
bf16_head = models["int4"].with_parts(lm_head=models["bfloat16"].lm_head)  # the int4 layers, no new weights
int8_head = models["int4"].with_parts(lm_head=models["int8"].lm_head)  # int8 weights, the input left in bfloat16
parts = {"bfloat16 (activations and weights)": models["bfloat16"], "int4 layers, bfloat16 head": bf16_head,
         "int4 layers, int8 head": int8_head,
         f"int4 layers, {formats.FORMATS['int4'][2]} head (the int4 format)": models["int4"]}
for label, m in parts.items():
    qd = agreement(ours, m, sequences, [len(p) - 1 for p in prompts])
    print(f"{label:<50} KL {qd['kl']:.5f} nats   top-1 agreement {qd['top1_agreement']:.3f}")

# %% [markdown]
# Read these lines with the table above it. `int4-float32` there (the same 4-bit layers, with float32
# activations and a float32 head) should sit at zero: the layers' blocks are the file's. So what separates the
# int4 format from the file is the bfloat16 arithmetic (the second line, beside plain bfloat16's first), the
# int8 head (the third), and rounding the head's input (the last; where oneDNN's integer product is missing or
# saturates, the int4 format keeps the int8 head, and the last two lines are the same model).

# %% [markdown]
# **What breaks first?** The file already rounded the layers to 4 bits; we can round further and watch the
# perplexity: symmetric 4-bit (one scale, no minimum), 4 bits in groups of 64, 3 bits and 2 bits, each
# applied either to every layer matrix or to the output head alone (the embedding lookup keeps the file's
# values). The first row applies the file's own rule again: on the layers it must change nothing.

# %%

print(f"{'scheme':<36} {'bits/weight':>11} {'layers':>10} {'head':>10}   (float32: {ppl['float32']:.3f})")
rounded = {}
for label, scheme in SCHEMES.items():
    rounded[label] = {part: perplexity(requantized(ours, scheme, part), text_ids) for part in ["layers", "head"]}
    print(f"{label:<36} {bits_per_weight(*scheme):>11.2f} {rounded[label]['layers']:>10.2f} {rounded[label]['head']:>10.2f}")
layer_weights = sum(getattr(layer, n).weight.numel() for layer in ours.layers for n in ("qkv", "o", "gate_up", "down"))
print(f"the head column rounds one matrix of {ours.lm_head.weight.numel() / 1e6:.1f} million weights; the layer column "
      f"{7 * len(ours.layers)} matrices (q, k, v, o, gate, up, down in each of {len(ours.layers)} layers) of "
      f"{layer_weights / 1e6:.1f} million")

# %% [markdown]
# Read the table row by row. The first row must repeat float32's perplexity in the layer column (the file's
# rule on the file's values); its head column is what a 4-bit head would cost, since the file keeps the
# head in 8 bits. Symmetric 4-bit and groups of 64 store the same 4.5 bits per weight in different ways:
# compare them. Then 3 and 2 bits. Perplexity is computed, not timed: your run gives the same figures as
# any other run of this torch version, up to float rounding. The head column rounds one matrix, the layer
# column hundreds (the sizes are printed under the table). So which single part is the most fragile?
# Round one layer at a time to 2 bits, on the first 256 tokens, and put the head beside them:

# %%
short = text_ids[:256]
two_bits = SCHEMES["2-bit min/max, 32"]
base_short = perplexity(ours, short)
per_layer = [perplexity(requantized(ours, two_bits, i), short) for i in progress(range(len(ours.layers)), "layers")]
head_short = perplexity(requantized(ours, two_bits, "head"), short)
worst = sorted(range(len(per_layer)), key=per_layer.__getitem__, reverse=True)[:3]
print(f"float32 {base_short:.2f}; head alone in 2 bits {head_short:.2f}; "
      + "; ".join(f"layer {i} alone {per_layer[i]:.2f}" for i in worst) + f"; median layer {sorted(per_layer)[15]:.2f}")
print("most fragile single part in this run:", "the head" if head_short > max(per_layer) else f"layer {worst[0]}")
plots_roofline.plot_layer_sensitivity(per_layer, base_short, head_short, "2-bit min/max, groups of 32")
plt.show()

# %% [markdown]
# The layers are not equal: most cost a moderate rise alone (the median printed), while one or two stand out (their
# position printed above). A quantizer that spends more bits on the fragile parts (llama.cpp's mixed
# "K-quant" files keep some tensors in more bits; the file here keeps the head in 8) gets more quality per
# byte than one rule for every matrix. That is why the `int4` format keeps an 8-bit head: the head column
# above is what 4 bits would cost, and section 7 prints what it would gain in speed.
#
# ## 6. Prefill is a different story
#
# Prefill multiplies many tokens by each weight matrix at once: it is bound by arithmetic, not by reading.
# What can help it is faster arithmetic, not fewer bytes: bfloat16 arithmetic where the CPU has
# instructions for it (the first line below says whether this one reports them), while the weight-only
# kernels are built for one row and unpack every weight again for each block of rows.

# %%

print("bfloat16 instructions on this CPU:", cpu_bfloat16(), "| threads:", torch.get_num_threads())
long_prompt = prompts[0] * 4  # about 100 tokens
prefill_ms = {}
for n in ["float32", "bfloat16", "int8", "int4"]:
    t = time_it(lambda n=n: prefill(models[n], long_prompt), repeats=3)
    prefill_ms[n] = 1000 * t.best
    print(f"{n:<9} prefill of {len(long_prompt)} tokens: {prefill_ms[n]:6.1f} ms (best of 3; slowest {1000 * max(t.seconds):.1f})")
fastest = min(prefill_ms, key=prefill_ms.get)
print(f"in this run: fastest prefill {fastest}; bfloat16 at {prefill_ms['float32'] / prefill_ms['bfloat16']:.2f}x float32's "
      f"speed, int4 at {prefill_ms['float32'] / prefill_ms['int4']:.2f}x")

# %% [markdown]
# Why? Put both stages on a roofline with its two ceilings measured now: the reading rate of section 4 and a
# large matrix product's rate in float32 and in bfloat16. Each step's operations are about 2 per weight per
# token plus attention's own; its bytes are the weights in its format plus the KV cache at that context.

# %%
from course_lib.inside.anatomy import flops_per_token
from course_lib.runner.kv_cache import model_kv_bytes_per_token
from course_lib.measure.roofline import compute_ceiling, place, step_work

peaks = {n: compute_ceiling(d) for n, d in [("float32", torch.float32), ("bfloat16", torch.bfloat16)]}
per_token = flops_per_token(sum(p.numel() for p in model.parameters()), model.config.vocab_size * model.config.hidden_size)
points = []
for n in ["float32", "bfloat16", "int8", "int4"]:
    kv = model_kv_bytes_per_token(model.config, models[n].dtype)
    decode_work = step_work(model.config, per_token, models[n].weight_bytes(), kv, 1, len(prompt))
    prefill_work = step_work(model.config, per_token, models[n].weight_bytes(), kv, len(long_prompt), 0)
    points += [(f"decode {n}", place(decode_work, step_ms[n] / 1000, peaks["float32"], read_bw)),
               (f"prefill {n}", place(prefill_work, prefill_ms[n] / 1000, peaks["float32"], read_bw))]
print(f"threads {torch.get_num_threads()} | reading {read_bw / 1e9:.1f} GB/s | matrix product float32 "
      f"{peaks['float32'] / 1e9:.0f} GFLOP/s, bfloat16 {peaks['bfloat16'] / 1e9:.0f} GFLOP/s")
for label, pt in points:
    print(f"{label:<18} {pt['intensity']:7.1f} FLOP/byte  {pt['flops_per_s'] / 1e9:7.1f} GFLOP/s  "
          f"(float32 ridge {pt['ridge']:.1f}: {pt['bound']} side)")
plots_roofline.plot_roofline([lbl for lbl, _ in points], [pt["intensity"] for _, pt in points],
                             [pt["flops_per_s"] for _, pt in points], peaks["float32"], read_bw,
                             other_peaks={"bfloat16 product": peaks["bfloat16"]})
plt.show()

# %% [markdown]
# Decode sits left of the ridge in every format: fewer bytes move its point right and up, which is why the
# formats speed it up. Prefill of a hundred tokens sits right of it: its ceiling is arithmetic, and only a
# faster product raises it. Where this CPU multiplies bfloat16 much faster than float32 (compare the two
# printed rates), bfloat16 prefill can climb above float32's roof; the weight-only formats unpack their
# weights back to floats first and stay well below it.

# %% [markdown]
# Read the verdict line. Where the CPU reports bfloat16 instructions, bfloat16 prefill is usually the
# fastest of the four (the committed runs on the course's machine, which has them, say so); without them,
# bfloat16 is emulated and can be the slowest by far. int8 and int4 are usually no faster than float32 at
# prefill, the reverse of their decode order. A loaded machine can reorder close timings: rerun the cell
# before you draw a conclusion from a gap of a few percent.
#
# ### Why the 4-bit kernel stays below the roof: it pays for every row
#
# A batch of decode rows meets the same wall as a prompt. Time one 4-bit matrix (layer 0's `gate_up`) called
# with 1 to 64 rows at once, and beside it a second kernel on the same weights: an int8 copy of them, each row
# of activations rounded to 8 bits with its own minimum and maximum, multiplied with integer dot products
# (`torch._int_mm`; `formats.int8_rows_product` writes the algebra out). The dotted line is what a kernel
# costs if every row were as dear as the first.

# %%
from course_lib.measure.fast_path import rows_cost
from course_lib.views.plots_perf import plot_rows_cost

if formats.int_mm_available():
    rows_model = formats.convert(ours, "int4", rows_int8=formats.ROWS_INT8)  # the int8 copy from that many rows
    course = models["int4-q8"].layers[0].gate_up  # the course's own kernel, where it runs here
    cost = rows_cost(models["int4"].layers[0].gate_up, rows_model.layers[0].gate_up,
                     course=course if course.q4 is not None else None)
    for i, (r, a, b) in enumerate(zip(cost["rows"], cost["int4_us"], cost["int8_us"])):
        c = cost.get("course_us", [])
        print(f"{r:>3} rows: 4-bit kernel {a:7.0f} us ({a / cost['int4_us'][0]:5.1f}x one row), "
              f"int8 copy {b:7.0f} us ({b / cost['int8_us'][0]:5.1f}x)"
              + (f", the course's kernel {c[i]:6.0f} us ({c[i] / c[0]:4.1f}x)" if c else ""))
    if course.q4 is None:
        print("the course's kernel does not run here:", course.why_not)
    else:
        from course_lib.runner.q4_kernel import best_variant
        print(f"the course's kernel here is its {best_variant()} build (vnni: AVX-512's dpbusd; avx2: maddubs)")
    plot_rows_cost(cost)
    plt.show()
    t = time_it(lambda: prefill(rows_model, long_prompt), repeats=3)
    rows_ppl = perplexity(rows_model, text_ids)
    print(f"prefill of {len(long_prompt)} tokens with the int8 copy: {1000 * t.best:.1f} ms against int4's "
          f"{prefill_ms['int4']:.1f} | perplexity {rows_ppl:.3f} against int4's {ppl['int4']:.3f} "
          f"({rows_ppl / ppl['int4'] - 1:+.2%}) | the copy's bytes: "
          f"{formats.int8_copy_bytes(rows_model) / 1e6:.0f} MB more")
else:
    print("torch._int_mm is missing or inexact here: formats.int_mm_available() says so, and the int4 format "
          "keeps its one kernel")

# %% [markdown]
# Read the ratios, not the microseconds. The 4-bit kernel's cost grows with the rows (it unpacks the weights
# again for every few rows). The integer product's depends on the CPU: on the course's machine with VNNI
# instructions (AVX-512 integer dot products, 2026-12-05) it hardly moved until the rows were many, so past a
# handful of rows the copy was the faster kernel and the prompt's prefill ran faster with it; on a CPU without
# them (AVX2 only), torch's integer product took longer than the 4-bit kernel at every row count, and the prefill
# with the copy was many times slower. Your lines above say which CPU this is. Three costs come with it, all printed above or measured in the bench: the copy holds a byte per weight
# more; the activations are rounded too, which moves perplexity (`formats.int8_rows_product`'s note says what
# rounding each row around zero instead would cost); and one matrix called in a loop stays in the
# CPU's cache, while a decode step reads the whole model from memory, where the copy's extra bytes count
# (`python -m course_lib bench --only engine` measures whole steps of 1 to 8 rows with and without it, under
# `batch_scaling.rows_int8`). The course builds it only when asked: `convert(ours, "int4", rows_int8=...)`.
#
# ### A kernel of our own: 4-bit weights times 8-bit activations
#
# The third curve, where this machine can run it, is the course's own kernel (`runner/q4_kernel.py`: a short
# C++ source the course compiles the first time a model is converted to `int4-q8`). It does what llama.cpp does
# on a CPU. Each block of 32 activations is rounded to 8 bits, its largest magnitude becoming the top level, with one
# float scale per block. The weights stay the file's 4-bit numbers with their float16 scale and minimum, laid
# out in tiles of 8 outputs, so that one register holds 4 consecutive weights of each of 8 outputs. One
# instruction (`maddubs`) then multiplies 32 pairs of small integers and adds them in pairs; each block's
# scales are applied once, in float: the sum over a block of (d q + m) times (a q') is d a (sum of q q') plus
# m a (sum of q'). A tile's weights are unpacked once for up to 4 rows of activations, but every row still pays
# for its own multiplications: read its ratio column, which grows with the rows even where its first row is
# the cheapest of the three kernels. On a CPU with AVX-512 VNNI the same source is built with `dpbusd`, one
# instruction that multiplies the bytes and adds each group of 4 into a 32-bit sum (AVX2 needs a second
# instruction to widen the sums): the rows cell above printed which build this machine got. That saves work per
# row, not bytes, so it shows at several rows and hardly at one.
#
# What it costs: the activations are rounded, so compare `int4-q8` with `int4` in section 5's perplexity lines;
# its head is the file's 8-bit embedding, read by the same kernel. What it needs: an x86 CPU with AVX2 and a
# C++ compiler; where either is missing, the format runs torch's kernel and prints why. Then read section 4's
# table again: `int4` and `int4-q8` read nearly the same bytes, so any gap between their steps is the kernel.
#
# ## 7. Against llama.cpp on the same file
#
# What a CPU user would run instead of this engine is llama.cpp, on the very same GGUF file. It is a C++
# program that compiles for minutes, so the course does not install it: `scripts/peers_cpu.py` ran both in
# one sitting on the course's machine (same token IDs, same file, 1 and 2 threads) and wrote the record read
# below. Your own int4 decode, timed here by the record's bare loop (argmax fed back, no picker or
# detokenizer), stands beside it; if `llama_cpp` is importable here, the cell also runs llama.cpp live.

# %%
import json
from pathlib import Path
from course_lib.measure.peers import bare_decode, describe, sitting_lines

records = sorted(Path("../data/benchmarks").glob("peers-cpu-*.json"))
record = json.loads(records[-1].read_text()) if records else None
if record:
    print(f"committed run {records[-1].name}:")
    print("\n".join(describe(record)))
    print("every committed sitting, decode tokens per second, the course's fastest against llama.cpp:")
    print("\n".join(sitting_lines({r.name: json.loads(r.read_text()) for r in records})))
else:
    print("no committed record: run scripts/peers_cpu.py (it needs llama-cpp-python in some environment)")
for name in ["int4", "int4-q8"]:
    yours = bare_decode(models[name], prompt, 32)
    print(f"yours, {name}, this run ({torch.get_num_threads()} thread(s), bare loop): decode "
          f"{yours['tokens_per_s']:.1f} tok/s")
if peers_llama.llama_cpp_available():
    from course_lib.loading import gguf_path
    llm = peers_llama.open_llama(gguf_path(), torch.get_num_threads(), n_ctx=len(prompt) + 40)
    live = peers_llama.llama_decode(llm, prompt, 32)
    print(f"llama.cpp, live here: decode {live['tokens_per_s']:.1f} tok/s")
else:
    print(f"llama.cpp is not installed here (optional): {peers_llama.INSTALL}")

# %% [markdown]
# Read the committed lines as one race: same file, same token IDs, same machine, same sitting. The
# comparison lines divide the course's fastest path by llama.cpp's at each thread count. Decode is one row
# at a time: the weights' bytes, then lesson 11's "everything else". The `course int4 compiled` rows are the same int4 model with its decode
# step at static shapes and compiled (lesson 11, section 10): the compile time is in the record, its prompt and
# perplexity are the int4 row's (the same ordinary pass), and its tokens can part from the int4 row's at a
# near-tie (the record's `first_difference_from_eager`). Prefill is many rows: arithmetic, and there the course's
# float formats go through oneDNN's and MKL's matrix kernels, which use the wide and matrix instructions
# this CPU has. Perplexity on the same text checks that the speed was not bought with quality: the float32
# weights are the file's own values, so float32 is the file's answer computed without rounding of the
# activations. The lines before the build say why the int4 format keeps an int8 output head: the head is a
# fifth of the weights, and the same int4 layers were timed with the head in bfloat16, int8 and 4 bits;
# compare what the 4-bit head gains in tokens per second with what it costs in perplexity (section 5's head
# column), and the int8 head whose input is rounded too (`int8-dynamic`, the int4 format's head where oneDNN's
# integer product runs) with what it gains and costs against the weight-only int8 head. Two cautions the record
# itself carries: llama.cpp was built without its AMX kernel (the default build crashed in it on that machine),
# and one sitting on a 2-core machine is one sample. The last lines above list every committed sitting: read how
# far each side's figure moved from one to the next before you read a ratio as a verdict.
#
# The `profile` lines split the compiled step's milliseconds, in the same sitting: the layers' matrix products
# and the head, each timed alone in the step's order (the weights' read), attention over the cache, the loop's
# own work (the argmax, the token made a tensor), and the rest, which is the step minus those: the generated
# kernels between the products and entering the compiled code. The floor is the weights' bytes at the
# streaming rate this machine measured: what a step that did nothing but read would take. llama.cpp's line
# gives its median gap and what its own timer says its decode calls took (the difference is the Python
# binding and the argmax around them). The figure draws them:

# %%
if record and record.get("profile"):
    plots_perf.plot_step_parts(record)
    plt.show()
else:
    print("the committed record has no profile: run scripts/peers_cpu.py again")

# %% [markdown]
# Compare each bar with its floor. Both engines read the same 4-bit blocks; what separates the two bars is the
# distance each keeps above the floor, and where in the course's bar that distance sits: in the products
# (a kernel reading its blocks below the streaming rate), or in the rest (work between the products).
#
# ### The rest, written as loops
#
# The course's step calls its kernel from Python four times a block, and between those calls runs the norms,
# rotary, the cache write, attention, SwiGLU and the residual adds as torch operators: a few thousand calls a
# token, each costing microseconds of calling for a few hundred numbers of arithmetic. `torch.compile` turns
# them into generated code but still enters that code, checks its guards and calls the kernel as an outside
# operator each time; on the course's CPU it bought nothing at one row. The other way is the one llama.cpp
# takes: write the glue as plain loops in the same C++ as the kernel, so a whole step is one call
# (`runner/fused_step.py`, `decode_layers` in `q4_kernel.cpp`). Its attention reads only the columns written so
# far, whatever the cache holds. Its numbers are the eager step's up to float rounding, except where a rounding
# difference moves one activation across an 8-bit step: then the logits move a little and a near-tie can flip.
# The same C++ also runs the `int4` format where the CPU has AVX-512 BF16 (an instruction that multiplies pairs
# of bfloat16 numbers): each product's activations go in as bfloat16, as that format's do, and its head's
# integer product runs on the course's kernel with the eager layer's rounding. One difference is kept on
# purpose: between the products the C++ stays in float32, where the eager `int4` model rounds every activation
# to bfloat16, so the two can part at a near-tie. The cell times the eager and fused steps of each format, one
# row, and says where their tokens part, if they do:

# %%
from course_lib.measure.compiled import first_difference, timed_static_run
from course_lib.runner.fused_step import why_not_fused
from course_lib.runner.static_step import StaticStep
from course_lib.runtime import median

for fmt in ("int4-q8", "int4"):
    why_not = why_not_fused(models[fmt])
    if why_not:
        print(f"{fmt}: no fused step on this machine: {why_not}")
        continue
    steps_ms, step_tokens = {}, {}
    for kind in ("eager", "fused"):
        step = StaticStep(models[fmt], len(prompt) + 40, fused=kind == "fused")
        step_tokens[kind], gaps = timed_static_run(step, prompt, 32)
        steps_ms[kind] = 1000 * median(gaps[1:])
        print(f"{fmt}, {kind} step: {steps_ms[kind]:.2f} ms a token ({torch.get_num_threads()} thread(s), "
              f"median of {len(gaps) - 1} gaps, the argmax included)")
    parted = first_difference(step_tokens["fused"], step_tokens["eager"])
    print(f"  the fused step {steps_ms['eager'] / steps_ms['fused']:.2f}x as fast; tokens "
          + ("the same" if parted is None else f"part at token {parted} (a near-tie)"))

# %% [markdown]
# For `int4-q8` both steps read the same weights with the same kernel, so the difference between its two lines
# is the glue alone. For `int4` the eager line also pays torch's 4-bit kernel and oneDNN's head, so its ratio
# mixes the glue with the kernels: read it as what `compiled=True` buys that format here, not as the glue's
# share. The engine takes the fused step whenever the model can run it: `generate(..., compiled=True)`, the
# batch schedulers and the contiguous-cache server run it for one row or many, with nothing to compile.
#
# ### A protocol that cannot flatter either side
#
# One sitting per side is a weak verdict: on a shared 2-core machine llama.cpp's own rate moved by a third
# between sittings, so a ratio read from one pair of runs says as much about the hour as about the engines.
# The record below comes from `scripts/peers_cpu.py paired`: every trial is a fresh process for one engine,
# pinned to its cores, on one GGUF file and one thread count; the course's compiled step holds as many
# columns as llama.cpp's context (both sized for a long conversation, though this one is short), and each
# reads only the columns written so far, rounded up (llama.cpp to a multiple of 256 cells, the course to
# its spans, lesson 11); llama.cpp
# runs with flash attention off and on, and the faster of the two is the one counted; the three trials of
# a pair run in an order that turns each pair, so a machine that slows down for a minute slows both sides.
# Each pair gives one ratio; the median of the ratios comes with a bootstrap interval (resample the pairs,
# take the median again, many times; the interval holds all but the outermost of those medians) and the
# range. The files are the course's Q4_1, a Q4_0 that llama.cpp's own quantizer made from it (the layout
# llama.cpp repacks for its fastest CPU kernels) and, in some sittings, a Q8_0. The course reads each through
# transformers' GGUF reader and runs its own format, named in each line: int4 keeps each block's own grid, so
# the blocks of Q4_1 and Q4_0 come through without a second rounding (only their scales are stored in
# bfloat16); int4-q8 keeps them too, with float16 scales, and runs the course's kernel of section 6 (a Q4_0
# file's blocks go in without their minimums, which are eight steps below zero: the file's own bytes); int8 has
# one scale per row, so Q8_0's blocks of 32 are rounded again. Its perplexity is measured through the compiled
# step itself, one token at a time. The newest sitting is printed in full; the earlier ones, each on its own
# machine, follow in one line per file and thread count.

# %%
from course_lib.measure import peers_protocol

paired_records = peers_protocol.paired_records(Path("../data/benchmarks"))  # a 1,024 context, oldest first
if paired_records:
    paired_record = json.loads(paired_records[-1].read_text())
    print(f"committed run {paired_records[-1].name}, CPU: {paired_record['processor']}")
    print("\n".join(peers_protocol.describe(paired_record)))
    for other in sorted(paired_records[-1].parent.glob(paired_records[-1].stem + "-context*.json")):
        print(f"\nthe same day, both caches sized for another context: {other.name}")
        print("\n".join(peers_protocol.describe(json.loads(other.read_text()))))
    llama_bench = sorted(Path("../data/benchmarks").glob("llama-bench-cpu-*.json"))
    if llama_bench:  # llama.cpp's own benchmark, from the same source
        print(f"\n{llama_bench[-1].name}:")
        print("\n".join(peers_protocol.describe_llama_bench(json.loads(llama_bench[-1].read_text()))))
    for older in paired_records[:-1]:  # earlier sittings: other machines, other course formats
        o = json.loads(older.read_text())
        print(f"\n{older.name} ({o['processor']}): " + "; ".join(
            f"{c['file']} {c['threads']} thread(s) {next(side for side in c['rates'] if side.startswith('course'))} / "
            f"{c['llama_counted']} {c['paired_ratio']['median']:.2f}x" for c in o["cells"]))
    plots_perf.plot_paired_ratios(paired_record)
    plt.show()
else:
    print("no paired record committed: run scripts/peers_cpu.py paired (it needs llama-cpp-python in a scratch "
          "environment; about an hour on an idle machine)")

# %% [markdown]
# Read the interval before the median. When the whole interval sits on one side of the dashed line, that
# sitting settles which engine decoded faster on that machine, that file and that thread count, and nothing
# wider: not another CPU (the record names the one it ran on and what llama.cpp was built for), not another
# context, not a server's many rows. When the interval straddles the line, the sitting settles nothing. The
# spread of the dots is the machine's noise within one hour; how far the next sitting's median lands from
# this one is the noise between hours, which no single record shows. The perplexity lines say whether the
# two engines computed the same model: the course's, through its compiled step, and llama.cpp's, on the same
# text and file. The second block, where the day has one, holds the same race with both caches sized for a
# longer context: if the course's rate barely moves between the two, its step reads what was written, not
# what was reserved. The last block, where the day has one, is llama.cpp's own benchmark (`llama-bench`,
# built from the same source): its timer covers the generated tokens only, with the cache empty (depth 0)
# and with a long conversation's worth of tokens already in it. Its depth-0 rows are a check on the paired
# trials' llama.cpp figures; its deeper rows show what a filled cache costs llama.cpp, which a short
# conversation never shows (the course's side of that is not measured here).
#
# Each line ends with what its interval settles, and the files can disagree: read them apart. Q4_1 is the
# file llama.cpp reads with its generic kernel; Q4_0 is the one it repacks for its fastest kernels. The older
# lines, one per sitting, tell the story of this race. In the first sitting of the sixth of December 2026 (an
# AMD CPU with AVX-512 VNNI, the course's step compiled by `torch.compile` on `int4-q8`) the course was ahead on
# Q4_1 and behind on Q4_0, with intervals that exclude a tie. An eager step on the Q4_0 file, timed beside that
# sitting, said why: about half of the course's step was the products (the weights read near the machine's
# streaming rate), the other half the thousands of small operators between them. The sitting after it ran the
# fused step of section 7's first part (`course_step` in the record: one C++ call a token), same machine, same
# day, same files. In it every interval lies above 1, Q4_0's too: the course decoded faster than llama.cpp's best
# path on that machine, at one thread and at two, for a short conversation in a cache of 1,024 columns. It says
# nothing about a longer context, prefill, another CPU, or a server's many rows. Compare sittings by their paired
# ratios, not by raw rates: each engine's own rate moves from one hour to the next on a shared machine, and the
# pairing is what cancels that. A caution about the Q4_0 line: the
# course's float32 model is the Q4_1 file, so its KL there measures the second rounding that llama.cpp's
# quantizer added when it made Q4_0, not an error of either engine (their perplexities on that file agree).
#
# **What this lesson does not build.** Production quantization goes further in three directions, none of them
# measured here. *Mixed formats* (llama.cpp's "K-quants", such as Q4_K_M): blocks grouped into super-blocks
# whose scales are themselves quantized, and the fragile tensors kept in more bits, the idea section 5's
# layer-by-layer table points at. *Calibrated rounding* (GPTQ, AWQ): the rounding is chosen with a little real
# text, so that the layer's outputs, not its weights, stay close (GPTQ corrects the error column by column;
# AWQ scales the channels that large activations pass through before rounding; llama.cpp's "importance
# matrix" is a cousin); whether the file here was rounded with any of them cannot be read from its blocks.
# *Quantized activations at scale* (W8A8, FP8 on recent GPUs): the activations are rounded too, as `int4-q8`
# rounds them, but into weights of 8 bits and the GPU's or CPU's matrix units, so the whole product runs in
# 8-bit arithmetic; it helps prefill, which is arithmetic-bound (section 6), where weight-only formats like
# these help decode, which is bound by reading.
#
# ## Summary
#
# - The file on disk, the model in memory and the bytes read per token are three different numbers;
#   decode speed follows the third.
# - Fewer bytes per weight make decode faster only through a kernel that reads those bytes directly:
#   casting int8 back to float first is slower than float32. And the kernel matters as much as the bytes:
#   `int4` and `int4-q8` read the same 4-bit blocks, through torch's kernel and through the course's own
#   (activations rounded to 8 bits per block, integer dot products); section 4 printed both steps, section 6
#   both kernels' cost for 1 to 64 rows, section 5 what the rounding costs in perplexity.
# - The course's float32 weights are the file's own 4-bit blocks, checked tensor by tensor against the file:
#   the 4-bit formats reproduce the file's model, so agreement with float32 measures distance to the file,
#   not quality. Quality is measured on text: perplexity on a page of a novel (section 5 printed each format's).
# - Prefill is bound by arithmetic: weight-only formats do not speed it up; bfloat16 arithmetic can, on a CPU
#   that has instructions for it (section 6 printed whether this one does, and what it measured).
# - Rounding further than the file did shows which parts are fragile: 2 bits on every layer breaks the model,
#   one layer at a time mostly does not, and a few layers and the head cost far more than the rest (the lines
#   printed in section 5 name them for this run).
# - Against llama.cpp on the same file (section 7), the committed record gives the ratio of the course's
#   fastest decode and prefill to llama.cpp's at 1 and 2 threads, with perplexity beside them: a ratio from one
#   sitting on one machine, with how llama.cpp was built. Its profile splits the compiled step's milliseconds
#   (the weights' read, attention, the loop, the rest) and sets them beside llama.cpp's and the read floor.
#   The paired record settles more, per file and thread count, only where its interval leaves out a tie.
#   With its step compiled by torch.compile the course trailed llama.cpp on the file llama.cpp repacks; with
#   the glue between the products written as loops (one C++ call a step), the newest sitting's lines say
#   where it stands. The same C++ runs `int4` with bfloat16 into its products where the CPU has the
#   instructions; section 7 printed whether this machine does, and how its step compares with the eager one.
#
# ---
# ## Exercises
#
# **1.** Write `predict(bytes_per_token, bytes_per_s)`: the tokens per second a format would reach if
# reading its weights were the only cost. The check compares it with the `int4` measurement above.

# %%
from course_lib.exercises import lesson12 as ex

def predict(bytes_per_token, bytes_per_s):
    ...  # your code here
    raise NotImplementedError

ex.check_predict(predict, models["int4"].weight_bytes(), read_bw, 1000 / step_ms["int4"])

# %% [markdown]
# **2.** Write `quantize(w)`: int8 with one scale per row, returning `(q, scale)`. The check compares your
# largest error with the course's quantizer.

# %%
def quantize(w):
    ...  # your code here
    raise NotImplementedError

ex.check_int8(quantize)

# %% [markdown]
# **3.** Write `block_params(w32)`: the scale and the minimum of one 32-weight block by the file's rule.

# %%
def block_params(w32):
    ...  # your code here
    raise NotImplementedError

ex.check_block(block_params)

# %% [markdown]
# **Next:** 13 · a server's memory: the KV cache in blocks, shared prefixes, and what a full pool does.

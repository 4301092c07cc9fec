"""How the course knows: the timed experiments, load tests and the benchmark's sections, apart from the engine.

What it does: `timers` holds the one best-of timer, the timed greedy loop (`greedy_gaps`) and a device-aware
stopwatch (the one median is runtime's); `speed` holds lesson 07's runs with and without a cache, lesson 09's
batch sizes and lesson 14's verify cost; `prefill_decode` is lesson 08's; `race` and `compiled` are lesson 11's
(ours against model.generate, step gaps, the profile, layout gains; the static step compiled); `memory`,
`quality` and `gguf_file` are lesson 12's (bandwidth ceilings; agreement and perplexity; the file's raw blocks);
`peers` and `peers_llama` compare with llama.cpp; `trace` is lesson 13's paged trace; `load` is the serving load
generator (Poisson arrivals over HTTP on loopback); `attention` and `long_context` are lessons 16 and 17's.
Each bench section is a `section.Section` declared beside its measurements (with `loop`, `engine_section`,
`formats`, `speculative`, `structured` and `serving` for the sections whose measurements live elsewhere); `bench`
runs them, reports their targets and saves the results. The engine's modules hold no timing experiments: they
only stamp when each token is chosen. (runner/layout.py times matrices once at build time, because the layout it
picks is the fastest one measured: that measurement is the engine's decision, not an experiment.)
What it does not do: decide anything the engine does. It may draw through views (bench saves a figure); views never
import it.
"""

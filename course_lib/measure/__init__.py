"""How the course knows: the timed experiments and load tests, apart from the engine.

What it does: `timers` holds the one median, the one best-of timer and a device-aware stopwatch; `speed`
holds lesson 07's runs with and without a cache, lesson 09's batch sizes and lesson 14's verify cost; `race`
is lesson 11's (ours against model.generate, step gaps, the profile, layout gains); `memory` and `quality`
are lesson 12's (bandwidth ceilings; agreement and perplexity); `trace` is lesson 13's paged trace; `load`
is the serving load generator (Poisson arrivals over HTTP on loopback); `bench` runs the benchmark's
sections (Part II's in `bench_part2`), reports its targets and saves the results. The engine modules
(generation, batching, kv_cache, paged, model, formats, speculative) hold no timing experiments: they only
stamp when each token is chosen. (layout.py times matrices once at build time, because the layout it picks
is the fastest one measured: that measurement is the engine's decision, not an experiment.)
What it does not do: draw (plots_perf.py) or decide anything the engine does.
"""

"""How the course knows: the timed experiments and load tests, apart from the engine.

What it does: `timers` holds the one median, the one best-of timer and a device-aware stopwatch that every
measurement uses; `speed` holds lesson 07's runs with and without a cache and lesson 14's verify cost;
`load` is the serving load generator (Poisson arrivals over HTTP on loopback, lessons 13 and the bench's
`serving_load` section). The engine modules (generation, batching, kv_cache, paged, model, formats,
speculative) hold no timing experiments of their own: they only stamp when each token is chosen.
What it does not do: draw (plots_perf.py) or decide anything the engine does.
Still outside this package, to be moved here: the bench sections (bench.py, bench_part2.py), engine_speed.py
and paged_runs.py (lesson 11-13 experiments).
"""

"""The engine: request (a request's record, result, stop conditions and text-out rule), sampling (pickers), stages
(prefill, decode_step, verify: each one runner call), schedulers (the Scheduler contract, Alone, the padded batch)
and paged_scheduler (lesson 13's), generation (the one step and the drivers above the schedulers), budget
(lesson 07's memory-budget simulation), speculative (drafters), structured (grammar masks), long_context (lesson
17's caches and strategies). Imports the runner and text below it; never the server, the views or measure."""

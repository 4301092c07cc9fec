"""The runner: what touches weights. forward (run_model, the one call into a model, and the Runner contract),
attention (its math written out) and attention_kernels (online softmax, tiles, paged decode), model (SmolLM2
written out), layout (each matrix by rows or columns, measured), formats (weight formats), static_step (the decode
step at fixed shapes, for torch.compile), fused_step (the int4-q8 decode step as one C++ call), q4_kernel (the
course's 4-bit kernel), and the caches a model is called with: kv_cache (the Cache contract and
the contiguous cache), blocks (a paged pool's bookkeeping) and paged (the block pool and the paged cache).
Never imports the engine, the server, the views or measure."""

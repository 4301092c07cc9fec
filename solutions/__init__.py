"""Solutions to the exercises, one module per lesson (kept out of the notebooks; checked by the tests)."""

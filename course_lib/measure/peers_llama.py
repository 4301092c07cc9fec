"""llama.cpp's side of the comparison with the course's engine (measure/peers.py), through llama-cpp-python.

What it does: on the GGUF file and the token IDs it is given (not text: every path reads the same IDs), greedy
decode tokens per second after a prompt (the median gap between tokens, prefill excluded), prefill tokens per
second on a long prompt, and perplexity on a text. Needs only numpy and llama_cpp, so that it also runs as a
script in a scratch environment that holds llama.cpp and no torch:
    python course_lib/measure/peers_llama.py ids.json model.gguf THREADS   (prints one JSON object)
What it does not do: install llama.cpp (it compiles for minutes: a scratch virtual environment, never set-up).
"""
import importlib.util
import json
import statistics
import sys
import time

INSTALL = ("pip install llama-cpp-python (it compiles llama.cpp for several minutes; in a scratch virtual "
           "environment, never in the course's .venv)")


def llama_cpp_available() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None


def open_llama(gguf_path, threads: int, n_ctx: int, logits_all: bool = False, flash: bool = False):
    """llama.cpp's model on the GGUF file, on the CPU, quiet, flash attention off or on. Raises ImportError with
    the install line."""
    if not llama_cpp_available():
        raise ImportError(f"llama.cpp is not installed here: {INSTALL}")
    from llama_cpp import Llama
    return Llama(model_path=str(gguf_path), n_threads=threads, n_threads_batch=threads, n_ctx=n_ctx,
                 n_batch=512, logits_all=logits_all, verbose=False, n_gpu_layers=0, flash_attn=flash)


def last_logits(llm):
    """The logits of the last evaluated position, read in place from llama.cpp's buffer (a numpy view).
    note: llama-cpp-python 0.3 no longer copies them into `scores` unless logits_all is set."""
    import numpy as np
    return np.ctypeslib.as_array(llm._ctx.get_logits_ith(-1), shape=(llm.n_vocab(),))


def llama_decode(llm, prompt_ids, n_new: int) -> dict:
    """Greedy decode: the prompt evaluated, then n_new tokens one by one (argmax of the last logits, evaluated
    back). Tokens per second from the median gap between tokens, as the course measures its own; and the
    milliseconds per token llama.cpp's own timer gives its decode calls (the mean, without the Python around them)."""
    llm.reset()
    llm.eval(list(prompt_ids))
    own_timer(llm, reset=True)
    tokens, gaps = [], []
    for _ in range(n_new):
        start = time.perf_counter()
        token = int(last_logits(llm).argmax())
        llm.eval([token])
        gaps.append(time.perf_counter() - start)
        tokens.append(token)
    return {"tokens": tokens, "tokens_per_s": 1 / statistics.median(gaps[1:]), "loop_tokens_per_s": len(gaps) / sum(gaps),
            "eval_ms_per_token": own_timer(llm)}


def own_timer(llm, reset: bool = False):
    """llama.cpp's own timer of its one-token decode calls since the last reset: milliseconds per call (None for a
    stand-in without a llama.cpp context, or before any call). reset=True starts it again."""
    ctx = getattr(getattr(llm, "_ctx", None), "ctx", None)
    if ctx is None:
        return None
    import llama_cpp
    if reset:
        llama_cpp.llama_perf_context_reset(ctx)
        return None
    perf = llama_cpp.llama_perf_context(ctx)
    return perf.t_eval_ms / perf.n_eval if perf.n_eval else None


def llama_prefill(llm, prompt_ids, repeats: int = 2) -> float:
    """Prefill tokens per second: the whole prompt evaluated from an empty context, best of `repeats`."""
    best = float("inf")
    for _ in range(repeats):
        llm.reset()
        start = time.perf_counter()
        llm.eval(list(prompt_ids))
        best = min(best, time.perf_counter() - start)
    return len(prompt_ids) / best


def llama_perplexity(llm, ids) -> float:
    """exp(mean negative log-likelihood of each next token of ids), from llama.cpp's logits (logits_all)."""
    import numpy as np
    llm.reset()
    llm.eval(list(ids))
    logits = np.asarray(llm.scores[:len(ids) - 1], dtype=np.float64)  # (T-1, V)
    top = logits.max(axis=1, keepdims=True)
    logp = logits - top - np.log(np.exp(logits - top).sum(axis=1, keepdims=True))
    nll = -logp[np.arange(len(ids) - 1), np.asarray(ids[1:])]
    return float(np.exp(nll.mean()))


def llama_path(gguf_path, threads: int, prompt_ids, long_ids, text_ids, n_new: int) -> dict:
    """llama.cpp at `threads`: decode and prefill with logits for the last position only (as the course's
    prefill), then perplexity with a second instance that keeps every position's logits."""
    llm = open_llama(gguf_path, threads, n_ctx=max(len(long_ids), len(prompt_ids) + n_new) + 8)
    llama_decode(llm, prompt_ids, 4)  # warm-up
    decode = llama_decode(llm, prompt_ids, n_new)
    out = {"decode_tokens_per_s": decode["tokens_per_s"], "prefill_tokens_per_s": llama_prefill(llm, long_ids),
           "greedy_tokens": decode["tokens"], "eval_ms_per_token": decode["eval_ms_per_token"]}
    del llm
    every = open_llama(gguf_path, threads, n_ctx=len(text_ids) + 8, logits_all=True)
    out["perplexity"] = llama_perplexity(every, text_ids)
    del every
    return out


def library() -> dict:
    """Which llama.cpp ran: llama-cpp-python's version, its library's sha256 and what llama.cpp says it was built with."""
    import hashlib
    from pathlib import Path
    import llama_cpp
    lib = Path(llama_cpp.__file__).parent / "lib" / "libllama.so"
    return {"llama_cpp_python": llama_cpp.__version__,
            "library_sha256": hashlib.sha256(lib.read_bytes()).hexdigest() if lib.exists() else None,
            "system_info": llama_cpp.llama_print_system_info().decode().strip()}


def decode_trial(gguf_path, threads: int, n_ctx: int, flash: bool, prompt_ids, n_new: int) -> dict:
    """One trial of the paired protocol (measure.peers_protocol): a fresh context of n_ctx tokens, a warm-up of 4
    tokens, then n_new greedy tokens after the prompt, the whole loop timed with its argmax."""
    llm = open_llama(gguf_path, threads, n_ctx=n_ctx, flash=flash)
    llama_decode(llm, prompt_ids, 4)  # warm-up
    return {**llama_decode(llm, prompt_ids, n_new), "flash": flash, "n_ctx": n_ctx, **library()}


if __name__ == "__main__" and sys.argv[1] == "decode":  # decode IDS GGUF THREADS N_CTX FLASH(0/1)
    ids = json.load(open(sys.argv[2]))
    print(json.dumps(decode_trial(sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), sys.argv[6] == "1", ids["prompt"],
                                  ids["n_new"])))
elif __name__ == "__main__" and sys.argv[1] == "perplexity":  # perplexity IDS GGUF THREADS
    ids = json.load(open(sys.argv[2]))
    llm = open_llama(sys.argv[3], int(sys.argv[4]), n_ctx=len(ids["text"]) + 8, logits_all=True)
    print(json.dumps({"perplexity": llama_perplexity(llm, ids["text"]), **library()}))
elif __name__ == "__main__":
    ids = json.load(open(sys.argv[1]))
    result = llama_path(sys.argv[2], int(sys.argv[3]), ids["prompt"], ids["long"], ids["text"], ids["n_new"])
    import llama_cpp
    result["llama_cpp_python"] = llama_cpp.__version__
    print(json.dumps(result))

"""Prefill and decode apart (lesson 18): blocks shipped as bytes over a socket continue a request with the tokens
of one process; a truncated transfer, blocks for an unknown request or for another cache are refused clearly."""
import socket
import threading

import pytest
import torch

from course_lib.engine.generation import generate
from course_lib.runner.model import Model
from course_lib.runner.paged import BlockPool
from course_lib.serve import disagg


@pytest.fixture(scope="module")
def small(tiny):
    return Model.from_transformers(tiny)


@pytest.fixture(scope="module")
def prompt(tokenizer):
    return tokenizer("Tell me about the makerspace and its laser cutter, please.", add_special_tokens=False)["input_ids"]


def ship(frame: bytes, cut: int | None = None):
    """Send a frame (or its first `cut` bytes) through a socket pair; what read_frame makes of it."""
    a, b = socket.socketpair()
    sender = threading.Thread(target=lambda: (a.sendall(frame[:cut] if cut is not None else frame), a.close()))
    sender.start()
    try:
        return disagg.read_frame(b)
    finally:
        sender.join()
        b.close()


def test_shipped_blocks_continue_with_the_tokens_of_one_process(small, tokenizer, prompt):
    alone = generate(small, tokenizer, prompt, 12, stop_ids=()).token_ids
    sender = BlockPool.for_model(small, 16)
    seq, first, _ = disagg.prefill_blocks(small, sender, prompt)
    sizes = {}
    for fmt in disagg.WIRE_FORMATS:
        header, payload = ship(disagg.pack(sender, seq, "r1", first, fmt))
        sizes[fmt] = len(payload)
        side = disagg.DecodeSide(small, 16)
        side.expect("r1", 12)
        got, allowance = side.accept(header, payload)
        tokens = side.decode(got, header["first_token"], allowance)
        assert side.pool.manager.num_used == 0 and len(tokens) == 12
        if fmt == "float32":
            assert tokens == alone
    per_token = 2 * len(small.layers) * small.kv_heads * small.head_dim  # keys and values, every layer
    assert sizes["float32"] == 4 * per_token * len(prompt) and sizes["bfloat16"] == sizes["float32"] // 2
    assert sizes["int8"] == per_token * len(prompt) + 2 * 2 * len(small.layers) * small.kv_heads * len(prompt)


def test_the_decode_side_batches_shipped_requests_with_one_process_tokens(small, tokenizer, prompt):
    from course_lib.engine.generation import step
    from course_lib.engine.request import Job
    from course_lib.serve.disagg_batch import ShippedScheduler
    prompts = {"a": prompt, "b": prompt[:9], "c": prompt[3:]}
    alone = {n: generate(small, tokenizer, p, 6, stop_ids=()).token_ids for n, p in prompts.items()}
    sender = BlockPool.for_model(small, 32)
    batch = ShippedScheduler(small, BlockPool.for_model(small, 32), max_batch=2)
    frames = {}
    for name, p in prompts.items():
        seq, first, _ = disagg.prefill_blocks(small, sender, p)
        frames[name] = (ship(disagg.pack(sender, seq, name, first)), first)
        sender.free(seq)
        batch.expect(Job(name, list(p), 6))
    with pytest.raises(disagg.TransferError, match="does not expect"):
        batch.adopt({**frames["a"][0][0], "request": "stranger"}, frames["a"][0][1])
    with pytest.raises(disagg.TransferError, match="not its"):
        batch.adopt({**frames["a"][0][0], "request": "b"}, frames["a"][0][1])  # a's blocks for b's prompt
    with pytest.raises(ValueError, match="unique"):
        batch.expect(Job("a", list(prompt), 6))
    jobs = [batch.adopt(*frames[n][0]) for n in ("a", "b")]
    step(batch)
    jobs.append(batch.adopt(*frames["c"][0]))  # arrives while two rows run: waits for a free row
    while batch.jobs:
        assert len(batch.running) <= 2
        step(batch)
    assert {j.name: j.tokens for j in jobs} == alone
    assert all(j.tokens[0] == frames[j.name][1] for j in jobs)  # the first token agrees with the prefill side's
    assert batch.pool.manager.num_used == 0 and not batch.seqs  # every block given back


def test_bad_transfers_are_refused(small, prompt):
    sender = BlockPool.for_model(small, 16)
    seq, first, _ = disagg.prefill_blocks(small, sender, prompt)
    frame = disagg.pack(sender, seq, "r1", first)
    with pytest.raises(disagg.TransferError, match="truncated transfer: the payload should be"):
        ship(frame, cut=len(frame) - 100)
    with pytest.raises(disagg.TransferError, match="not a KV transfer frame"):
        ship(b"GET / HTTP/1.1\r\n\r\n")
    header, payload = ship(frame)
    side = disagg.DecodeSide(small, 16)
    with pytest.raises(disagg.TransferError, match="does not expect"):
        side.accept(header, payload)
    side.expect("r1", 4)
    with pytest.raises(disagg.TransferError, match="made for a cache of"):
        side.accept({**header, "kv_heads": header["kv_heads"] + 1}, payload)
    with pytest.raises(disagg.TransferError, match="accounts for"):
        side.accept({**header, "computed": header["computed"] - 1}, payload)
    assert side.pool.manager.num_used == 0  # a refused transfer leaves no block behind
    with pytest.raises(ValueError, match="wire format"):
        disagg.pack(sender, seq, "r1", first, "int4")


@pytest.mark.slow
def test_a_prefill_process_ships_to_this_one(model, tokenizer, prompt):
    ours = Model.from_transformers(model)
    alone = generate(ours, tokenizer, prompt, 8, stop_ids=()).token_ids
    worker = disagg.PrefillProcess().start()
    try:
        header, payload, seconds = worker.ask("r1", prompt)
        from course_lib.measure.fleet import shipped_gaps
        running = tokenizer("Once upon a time", add_special_tokens=False)["input_ids"]
        gaps = shipped_gaps(ours, worker, running, prompt, new_tokens=6, warmup=2, after=2)
    finally:
        worker.stop()
    # a running answer decoded on while the prompt was read in the prefill process, and went on after its blocks
    assert gaps["arrived_after_tokens"] >= 2 and gaps["gaps"] >= max(5, gaps["arrived_after_tokens"] + 1)
    assert 0 < gaps["median_gap_s"] <= gaps["p99_gap_s"] <= gaps["max_gap_s"]
    side = disagg.DecodeSide(ours, 16)
    side.expect("r1", 8)
    seq, allowance = side.accept(header, payload)
    assert side.decode(seq, header["first_token"], allowance) == alone
    assert header["payload_bytes"] == len(payload) == 2 * 30 * 3 * 64 * 4 * len(prompt) and seconds > header["prefill_s"]

import torch

model = tokenizer = None


def my_left_pad(sequences, pad_id):
    T = max(len(s) for s in sequences)
    ids = torch.tensor([[pad_id] * (T - len(s)) + list(s) for s in sequences])
    mask = torch.tensor([[0] * (T - len(s)) + [1] * len(s) for s in sequences])
    return ids, mask


def waste_fraction(lengths):
    return sum(max(lengths) - n for n in lengths) / (max(lengths) * len(lengths))


def mean_latency(jobs):
    return sum(j.end for j in jobs) / len(jobs)


def batch_prediction(prompt_ids, batch=12):
    """Halfway, in batch size, between the measured batches of 8 and 16."""
    from course_lib.measure.speed import throughput_latency
    eight, sixteen = (r["tokens_per_s"] for r in throughput_latency(model, list(prompt_ids), [8, 16], 32))
    return eight + (sixteen - eight) * (batch - 8) / 8

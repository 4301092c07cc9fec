"""Solutions for 12_bytes_per_token."""
import torch

model = tokenizer = None


def predict(bytes_per_token, bytes_per_s):
    return bytes_per_s / bytes_per_token


def quantize(w):
    scale = w.abs().amax(dim=1) / 127
    return torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8), scale


def block_params(w32):
    return (w32.max() - w32.min()) / 15, w32.min()

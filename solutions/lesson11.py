"""Solutions for 11_model_from_scratch."""
import torch

model = tokenizer = None


def rms_norm(x, weight, eps):
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rotate(x, position, theta=100000.0):
    D = x.shape[-1]
    angles = position / theta ** (torch.arange(0, D, 2, dtype=torch.float32) / D)  # (D/2,)
    angles = torch.cat([angles, angles])
    half = D // 2
    return x * angles.cos() + torch.cat([-x[half:], x[:half]]) * angles.sin()


def cache_bytes(batch, tokens, layers=30, kv_heads=3, head_dim=64, bytes_per_number=4):
    return 2 * layers * kv_heads * head_dim * bytes_per_number * tokens * batch

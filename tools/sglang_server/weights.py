"""Dummy weights at which a model's output depends on its prompt (and so on the KV cache it reads).

SGLang's own dummy init fills every parameter with uniform +-1e-3, the same values for every parameter
of one size. The logits then come out flat (every logprob -ln(vocab)) whatever the prompt, so two
servers agree whatever bytes their KV caches hold, and an equality test can not fail. Here instead:

* norm weights are 1 and other 1-D parameters (biases, correction terms) 0;
* every matrix is uniform in +-sqrt(3 / fan_in) (unit variance through each layer), embeddings +-1;
* each parameter draws from its own generator, seeded by its name, so layers differ and every
  process (and every rank) makes the same weights.
"""

from __future__ import annotations

import math
import zlib


def _is_norm(name: str) -> bool:
    leaf = name.rsplit(".", 2)
    owner = leaf[-2] if len(leaf) > 1 else ""
    return "norm" in owner or owner.endswith("ln") or "layernorm" in name


def fill(model, seed: int = 1234) -> int:
    """Fills every floating-point parameter and buffer of ``model`` in place; returns how many."""
    import torch

    count = 0
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if not torch.is_floating_point(tensor):
                continue
            count += 1
            if tensor.dim() <= 1:
                tensor.fill_(1.0 if _is_norm(name) and name.endswith("weight") else 0.0)
                continue
            fan_in = tensor.shape[-1]
            bound = 1.0 if "embed" in name else math.sqrt(3.0 / fan_in)
            generator = torch.Generator(device=tensor.device)
            generator.manual_seed((seed * 1000003 + zlib.crc32(name.encode())) % (2**63))
            if torch.finfo(tensor.dtype).bits < 16:  # uniform_ has no 8-bit kernels
                tmp = torch.empty(tensor.shape, dtype=torch.float16, device=tensor.device)
                tensor.copy_(tmp.uniform_(-bound, bound, generator=generator).to(tensor.dtype))
            else:
                tensor.uniform_(-bound, bound, generator=generator)
    return count

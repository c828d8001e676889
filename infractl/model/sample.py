"""Text from a consolidated model, so a person can see what the run learned.

The vocabulary is the 256 byte values (trainer/model.py, trainer/data.py): a prompt's UTF-8 bytes
are its tokens and every generated token is one byte. The caller decodes the bytes (with
``errors="replace"``: the model may well cut a character in two).
"""

from __future__ import annotations

import torch

from trainer.model import GPT

__all__ = ["generate"]

#: What an empty prompt stands for: the start of a line, a byte every corpus has.
_START = b"\n"


@torch.no_grad()
def generate(model: GPT, prompt: bytes, *, tokens: int, temperature: float, seed: int) -> bytes:
    """``tokens`` bytes that follow ``prompt``, one at a time: sampled from the model's
    distribution sharpened by ``temperature`` (0: always the likeliest byte), the same bytes for
    the same seed. The model sees the last ``seq_len`` bytes, its whole context."""
    generator = torch.Generator().manual_seed(seed)
    context = list(prompt or _START)
    generated = bytearray()
    # One thread: the thread count is part of the CPU arithmetic (trainer.stateful.make_deterministic),
    # and a logit that moves in its last bit may change a sampled byte on another machine.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for _ in range(tokens):
            window = torch.tensor([context[-model.cfg.seq_len :]], dtype=torch.long)
            logits = model(window)[0, -1].double()
            if temperature == 0:
                byte = int(logits.argmax())
            else:
                # Shifted so the largest is 0: a tiny temperature gives -inf, never inf - inf (NaN).
                probs = torch.softmax((logits - logits.max()) / temperature, dim=0)
                byte = int(torch.multinomial(probs, 1, generator=generator))
            context.append(byte)
            generated.append(byte)
    finally:
        torch.set_num_threads(threads)
    return bytes(generated)

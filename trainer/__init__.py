"""Code that runs on every training node under torchrun.

``train`` (entry point) -> ``engine.Trainer`` (the loop), built from ``model`` (byte-level GPT),
``data`` (per-rank training and validation batches over an ``infractl.dataset``), ``optimizer``
(AdamW + schedule), ``parallelize`` (DDP, ZeRO-1 or FSDP2, activation checkpointing, bf16),
``distributed`` (process group), ``state`` (what a checkpoint holds), ``checkpoint`` (async DCP to
the store and back), ``metrics`` (per-step records and TensorBoard) and ``fingerprint`` (the
environment a run ran in).
"""

"""Code that runs on every training node under torchrun.

``train`` (entry point) -> ``engine.Trainer`` (the loop), built from ``model`` (byte-level GPT),
``data`` (corpus and per-rank batches), ``optimizer`` (AdamW + schedule), ``parallelize`` (DDP),
``distributed`` (process group), ``state`` (what a checkpoint holds), ``checkpoint`` (DCP to the
store and back) and ``metrics`` (per-step records).
"""

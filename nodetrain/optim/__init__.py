"""Optimizers: CPU AdamW on the host store's flat per-unit fp32 buffers, LR schedule, clipping.

Owns the update rule and its per-unit state in the store.
Must not import data, engine, checkpoint, run, plan or train (only config, store, model).
"""

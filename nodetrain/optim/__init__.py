"""Optimizers: CPU AdamW on the host store's flat per-unit buffers (fp32 ``full``, quantized ``lean``).

Owns the update rules, LR schedule, clipping, and their per-unit state in the store.
Must not import data, engine, checkpoint, run, plan or train (only config, store, model).
"""

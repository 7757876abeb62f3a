"""Data: corpora, tokenizers, dataset preparation (``python -m nodetrain.data``), SFT, sampler, checks.

Owns what a batch contains: token memmaps, loss masks, the deterministic sampler.
Must not import model, optim, engine, checkpoint, run, plan or train (only config and store).
"""

"""Run bookkeeping: what a run shows and survives: metrics, step breakdown, plots, output dirs, jobs, faults.

Owns the run directory's files besides checkpoints, and failure records.
Must not import data, engine, plan or train (only config, store, model, optim, checkpoint).
"""

"""Core: pure decisions the engine and the planner both stand on, each made in one place.

Owns the pipeline schedule (``schedule``), a rank's place (``topology``), the one rule of when a
block is loaded, offloaded and final (``step_plan``), where each unit's state lives within a device
budget (``placement``), the update mode (``update``), the split of a rank's cores (``cores``) and
``resolve(cfg, machine) -> RunShape`` (``run_shape``), which turns every ``auto`` into a number once.
Prices with ``cost/``; imports no torch.distributed, starts no thread, touches no device.
"""

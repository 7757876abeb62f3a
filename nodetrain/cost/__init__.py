"""Cost model: what a run costs, as pure arithmetic over given shapes, sequences and rates.

Owns bytes (host store, device memory per stage: ``memory``; per step over the link and through host
DRAM: ``traffic``), work (FLOPs and elementwise bytes: ``compute``) and seconds (``step_time``,
``exposure``, ``tier``), from a model's shape (``shape``) and what each stage's step does (``work``).
Decides nothing: which blocks stay on the device, the schedule and the update mode are ``core/``'s, and
this package never imports it. Imports no torch.distributed, starts no thread, touches no device.
"""

"""The processes the benchmarks start: rank workers under ``torchrun`` (``dist_bench``, ``host_sync_worker``), the
GPU bench's runs (``gpu_bench``) and what they share (``gpu_common``, ``probe``); each runs as ``python -m
benchmarks.workers.NAME``."""

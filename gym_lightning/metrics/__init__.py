"""Metric math in pure functions, apart from the callbacks that hook it into training (``gym_lightning.callbacks``).

- :mod:`~gym_lightning.metrics.flops`: model FLOPs per trained token of a decoder-only transformer;
- :mod:`~gym_lightning.metrics.hardware`: the hardware catalog (GPUs, links, fabrics, host) read from
  ``assets/hardware.yaml``;
- :mod:`~gym_lightning.metrics.peak_flops`: dense peak FLOP/s per chip and dtype, for MFU;
- :mod:`~gym_lightning.metrics.throughput`: counters sampled at log points turned into rates;
- :mod:`~gym_lightning.metrics.memory`: the bytes of parameters, gradients and optimizer state a rank holds.

Nothing here imports Lightning: the planner, the benchmarks and other trainers use them as they are.
"""

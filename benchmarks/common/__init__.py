"""What the benchmarks share, one module per concern (each imports its heavy dependencies where they are used, so
that ``--help`` and the result collectors stay fast):

- ``paths``: the repository's folders and documents; ``launch``: free ports, child processes with the repository
  on their path, ``torchrun`` and spawned gloo ranks; ``records``: JSON-lines results a killed run still hands back;
- ``memory``: peak meters over ``gym_lightning.metrics.memory`` (a sampling thread, the process's peak RSS);
- ``models``: random-weight model folders of each benchmark size and tiny ones of every family;
- ``docs``: replacing one benchmark's section of docs/benchmarks.md or docs/planner.md; ``ratios``: the speed ratio
  statistic and its verdict;
- instruments the tests use too: ``host_syncs`` (the per-step host-sync census), ``sync_census`` (one call's),
  ``ddp_graphs`` (graphs per compiled layer), ``routed_reference`` (the routed experts forward before issue 55).
"""

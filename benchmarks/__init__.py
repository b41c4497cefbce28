"""gym_lightning's benchmark suite: each module here is one benchmark, run from the repository root as a module.

    python -m benchmarks.run --quick          # gym_lightning against its peers; docs/benchmarks.md
    python -m benchmarks.scale --sizes 250m   # any other benchmark the same way (``--help`` says what it measures)
    bash benchmarks/gpu.sh                    # the single-GPU checks and benchmarks

``python -m`` puts the current folder (the repository root) first on ``sys.path``, so ``benchmarks`` and the
working tree's ``gym_lightning`` import without any path set-up; child processes get the root on ``PYTHONPATH``
(``benchmarks.common.launch.child_env``). ``benchmarks.common`` holds what the benchmarks share; ``benchmarks.workers``
the processes they start. benchmarks/README.md lists them. Nothing here imports ``tests``; tests import from here.
"""

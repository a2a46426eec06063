"""The benchmarks: scripts that measure (time, memory, bytes, throughput) and leave a table of figures, dated, in
``benchmarks/results/``. The checks with pass / fail targets are in ``benchmarks.acceptance`` (README.md in each
folder says which goes where).

Each script is a module run from the repository root, ``python -m benchmarks.<name>``, so that this checkout's
``ddp_rank`` and ``benchmarks`` are the ones imported (``python -m`` puts the current folder first on
``sys.path``); shared helpers are ``benchmarks.common``. A package, not a folder of scripts, so that nothing
puts a folder on ``sys.path`` by hand and the tests import the scripts as they import ``ddp_rank``.
"""

"""The acceptance harness: checks with pass / fail targets (``make gpu-check``, the soak, the gradient, feed,
chunk-size and host-synchronisation checks), judged by ``gpu_targets`` or by the check itself, and the instrument
they and the tests share (``host_syncs``). The scripts that only measure are the package above,
``benchmarks``; README.md here says which goes where.

Run from the repository root: ``python -m benchmarks.acceptance.<name>``.
"""

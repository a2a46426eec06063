"""Experiments over many runs: sweeps of config values (``grid``, ``sweep``) and their comparison (``runs``,
``compare``, ``plot``). Above ``train`` and ``eval``: it reads what runs write and starts the trainer's command."""

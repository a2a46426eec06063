"""The trainer's checkpoints: writing a step's state and resuming a run from it.

- ``write``: the checkpoint layout written during training (weights, state, ``meta.json`` last);
- ``checkpointer``: the run's state objects (``state_dict`` / ``load_state_dict``) saved into it and restored;
- ``state_files``: the training state ddp-rank writes itself (the schedule, a loss's parameters);
- ``resume_check``: what changed between a checkpoint's config and the resumed run's;
- ``resume``: picking the newest intact checkpoint, the checks, and restoring a run from it.

Reading a checkpoint's weights is the model layer's (``ddp_rank.model.checkpoint_read``, which evaluation and
deployment use too); the digests of a run's files are ``ddp_rank.file_checks``.
"""

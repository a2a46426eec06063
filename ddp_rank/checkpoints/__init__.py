"""Checkpoints, end to end: writing a step's state, reading it back, checking its files, resuming a run.

A vertical slice; each module keeps the layer of what it does (ARCHITECTURE.md):

- ``file_checks`` (base): digests of the files a run writes, checked before anything parses them;
- ``safe_pickles`` (model): reading torch pickles without running code a file names;
- ``read`` (model): finding a run's checkpoints and loading a model's weights from one;
- ``write`` (train): the checkpoint layout written during training (weights, state, meta.json last);
- ``state_files`` (train): the training state ddp-rank writes itself (schedule, a loss's parameters);
- ``resume_check`` (train): what changed between a checkpoint's config and the resumed run's;
- ``resume`` (train): picking the newest intact checkpoint and restoring a run from it.

This ``__init__`` imports nothing, so the model layer can read checkpoints without importing the trainer's side.
"""

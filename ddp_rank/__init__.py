"""ddp_rank: exact global-batch listwise ranking losses for distributed deep metric learning."""

__version__ = "0.1.0"

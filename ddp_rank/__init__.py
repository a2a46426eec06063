"""ddp_rank: exact global-batch listwise ranking losses for distributed deep metric learning."""

from ddp_rank import _moved

__version__ = "0.1.0"

_moved.install()  # the old import paths of moved modules, with a DeprecationWarning (ddp_rank/_moved.py)

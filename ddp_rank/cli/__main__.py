"""``python -m ddp_rank.cli``: the ``ddp-rank`` command (what ``accelerate launch -m ddp_rank.cli`` starts)."""

import sys

from ddp_rank.cli import main

sys.exit(main())

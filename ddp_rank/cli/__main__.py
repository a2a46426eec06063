"""``python -m ddp_rank.cli``: the ``ddp-rank`` command (what ``accelerate launch -m ddp_rank.cli`` starts).

A rank of a multi-process launch ends with ``os._exit`` once its command has returned: every file is written and
closed by then (checkpoints renamed into place, the metrics log and the run's state flushed), and skipping the
interpreter's teardown avoids a native abort ("terminate called without an active exception", SIGABRT) that
torch's teardown of the gloo process group's threads hit about once in ten runs on a loaded 2-core machine,
after the work was done, making the launcher report a finished run as a failure.
"""

import logging
import sys

from ddp_rank.cli import main
from ddp_rank.runtime.failure import end_process_now, launch_world_size

code = main()
if launch_world_size() > 1:
    logging.shutdown()
    end_process_now(code)
sys.exit(code)

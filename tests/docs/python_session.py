"""One page's Python session for tests/docs/code_blocks.py: runs the blocks it is sent in one namespace.

Protocol: a JSON request a line on stdin, ``{"code", "name", "log"}``; the block runs with its stdout and stderr
(file descriptors 1 and 2, so its subprocesses' output too) in the file ``log`` and stdin on /dev/null; the
answer, ``{"ok", "error"}`` (the traceback), goes as one line to the original stdout, which no block writes to.
A block's ``sys.exit(0)`` counts as success. Started as a script (stdlib only), in the page's folder.
"""

import json
import os
import sys
import traceback


def _run(code: str, name: str, namespace: dict) -> str:
    """Run one block; the traceback text if it failed, "" if it passed."""
    try:
        exec(compile(code, name, "exec"), namespace)
    except SystemExit as exc:
        if exc.code not in (None, 0):
            return f"SystemExit({exc.code!r})\n"
    except BaseException:
        return traceback.format_exc()
    return ""


def main() -> None:
    answers = os.fdopen(os.dup(1), "w")
    devnull = os.open(os.devnull, os.O_RDONLY)
    namespace = {"__name__": "__main__"}
    for line in sys.stdin:
        request = json.loads(line)
        log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        saved = [os.dup(fd) for fd in (0, 1, 2)]
        os.dup2(devnull, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        try:
            error = _run(request["code"], request["name"], namespace)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            for fd, copy in zip((0, 1, 2), saved):
                os.dup2(copy, fd)
                os.close(copy)
            os.close(log)
        answers.write(json.dumps({"ok": not error, "error": error}) + "\n")
        answers.flush()


if __name__ == "__main__":
    main()

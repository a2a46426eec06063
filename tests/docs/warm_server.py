"""A warm interpreter for the documentation's commands (tests/docs/code_blocks.py): a server that imported the
heavy modules once and forks a fresh process for each command a page's bash block runs.

Why: every ``ddp-rank`` a page runs is a new Python process that spends 2 to 5 s of CPU importing torch (and,
for ``train``, accelerate and torch._dynamo) before it does anything; the pages run about fifty of
them. Forked from a server that has those modules in memory, the same command spends a fraction of that.

What stays as it was: each command is still a process of its own, running the real console script (by its path,
as ``__main__``, with ``sys.argv`` as the shell gives it), in the block's working directory, with the block's
environment and the block's stdin, stdout and stderr (the very file descriptors: ``> log``, ``|`` and ``2>&1``
behave as with a cold start). The shell sees a small stand-in process (the shim the runner writes) that forwards
every signal it gets to the command, waits for it and ends with its status (a command killed by a signal kills
the shim with the same signal), so ``cmd &``, ``kill -USR1 $!`` and ``wait`` mean what they mean for the real
command. A shim that dies (the block timed out) takes its command's process group with it.

What differs: the preloaded modules are already imported. The runner preloads only modules the command imports
anyway on a cold start, imported with the same environment (a request whose environment differs from the
server's in anything but the shell's bookkeeping runs cold instead), and numpy's global generator is reseeded as
a fresh import would (Python's ``random`` reseeds itself after a fork).

Protocol (one connection per command, on a Unix socket): the shim sends one JSON line ``{"argv", "cwd", "env"}``
with its file descriptors 0, 1 and 2 attached; the server answers ``cold`` (run it cold yourself) or ``pid N``,
then, when the command ends, ``exit N`` or ``signal N``. A server that cannot be reached means: run cold.

Started as a script (stdlib only): ``python warm_server.py SOCKET SCRIPT MODULE...``. It preloads the modules,
then serves until its parent (the test process) is gone.
"""

import contextlib
import importlib
import json
import os
import runpy
import select
import signal
import socket
import sys
import threading

# What a shell or the test harness changes between commands; anything else that differs makes a request cold.
UNCHECKED = frozenset({"PWD", "OLDPWD", "SHLVL", "_", "PYTEST_CURRENT_TEST"})


def _same_environment(env: dict, own: dict) -> bool:
    keys = (set(env) | set(own)) - UNCHECKED
    return all(env.get(key) == own.get(key) for key in keys)


def _exit_code(code: object) -> int:
    """The status ``sys.exit(code)`` gives a process (a message is printed to stderr, status 1)."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def _run_command(script: str, request: dict, fds: list[int], imported: dict) -> int:
    """In the forked child: become the command, run the script as ``__main__`` and end as the interpreter
    would (non-daemon threads joined, atexit handlers run, streams flushed). Returns the exit status."""
    os.setpgid(0, 0)
    with contextlib.suppress(Exception):  # Linux: die with the process that waits for us
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    for key, value in imported.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    for sig in range(1, signal.NSIG):  # a fresh interpreter's dispositions
        with contextlib.suppress(OSError, ValueError, RuntimeError):
            signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    sys.argv = [script, *request["argv"][1:]]
    sys.path[0] = os.path.dirname(script)
    try:
        runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as exc:
        code = _exit_code(exc.code)
    except KeyboardInterrupt:
        code = -signal.SIGINT
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    with contextlib.suppress(BaseException):
        threading._shutdown()  # type: ignore[attr-defined]  # what the interpreter does at exit
    import atexit

    with contextlib.suppress(BaseException):
        atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(BaseException):
            stream.flush()
    return code


def _keep(conn: socket.socket, script: str, request: dict, fds: list[int], imported: dict) -> None:
    """In a forked keeper: fork the command, tell the shim its pid, wait for it (or kill its group when the
    shim goes away), then tell the shim how it ended."""
    child = os.fork()
    if child == 0:
        conn.close()
        code = _run_command(script, request, fds, imported)
        if code < 0:
            signal.signal(-code, signal.SIG_DFL)
            os.kill(os.getpid(), -code)
        os._exit(code)
    with contextlib.suppress(OSError):  # the child does it too: whichever runs first, the group exists
        os.setpgid(child, child)
    for fd in fds:
        os.close(fd)
    conn.sendall(f"pid {child}\n".encode())
    while True:
        readable, _, _ = select.select([conn], [], [], 0.05)
        done, status = os.waitpid(child, os.WNOHANG)
        if done:
            if os.WIFSIGNALED(status):
                answer = f"signal {os.WTERMSIG(status)}\n"
            else:
                answer = f"exit {os.waitstatus_to_exitcode(status)}\n"
            with contextlib.suppress(OSError):
                conn.sendall(answer.encode())
            return
        if readable and not conn.recv(1):  # the shim is gone (killed): so is its command
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child, signal.SIGKILL)
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGKILL)
            os.waitpid(child, 0)
            return


def _receive(conn: socket.socket) -> tuple[dict, list[int]]:
    data, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
    while not data.endswith(b"\n"):
        more = conn.recv(1 << 20)
        if not more:
            raise ConnectionError("the request ended early")
        data += more
    return json.loads(data), fds


def serve(address: str, script: str, modules: list[str]) -> None:
    parent = os.getppid()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(address)
    listener.listen(64)  # before the imports: a shim that connects meanwhile waits for them
    own = dict(os.environ)
    for module in modules:
        importlib.import_module(module)
    # What the imports did to the environment (torch._dynamo sets TORCHINDUCTOR_CACHE_DIR, ...), as they would
    # have done in the command's own process.
    imported = {
        key: os.environ.get(key) for key in set(own) | set(os.environ) if own.get(key) != os.environ.get(key)
    }
    listener.settimeout(1.0)
    while os.getppid() == parent:
        with contextlib.suppress(ChildProcessError):
            while os.waitpid(-1, os.WNOHANG)[0]:
                pass
        try:
            conn, _ = listener.accept()
        except TimeoutError:
            continue
        conn.settimeout(None)
        try:
            request, fds = _receive(conn)
        except (OSError, ValueError):
            conn.close()
            continue
        if len(fds) != 3 or not _same_environment(request["env"], own):
            for fd in fds:
                os.close(fd)
            with contextlib.suppress(OSError):
                conn.sendall(b"cold\n")
            conn.close()
            continue
        if os.fork() == 0:
            listener.close()
            try:
                _keep(conn, script, request, fds, imported)
            finally:
                os._exit(0)
        for fd in fds:
            os.close(fd)
        conn.close()


if __name__ == "__main__":
    serve(sys.argv[1], sys.argv[2], sys.argv[3:])

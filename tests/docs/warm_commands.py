"""The commands a page's bash blocks run forked from a warm server (tests/docs/warm_server.py): the shim that
stands in for each on PATH, and the servers, started once per test process (docs/code-blocks.md, "The
project's tools"). Split from the runner (tests/docs/code_blocks.py), which uses :class:`WarmCommand` and
:func:`warm_set`.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

WARM_SERVER = Path(__file__).with_name("warm_server.py")


def kill_group(proc: subprocess.Popen[str] | subprocess.Popen[bytes]) -> None:
    """Kill ``proc``'s process group (it was started in a session of its own) and reap it."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


# The signals a shim passes on to its command (SIGKILL and SIGSTOP cannot be caught: a killed shim kills its
# command through the server instead).
_FORWARDED = ("SIGHUP", "SIGINT", "SIGQUIT", "SIGTERM", "SIGUSR1", "SIGUSR2", "SIGALRM")
# What a shell or the harness changes between commands (warm_server.UNCHECKED): not part of a server's key.
_UNCHECKED = frozenset({"PWD", "OLDPWD", "SHLVL", "_", "PYTEST_CURRENT_TEST"})


@dataclass(frozen=True)
class WarmCommand:
    """A console script the pages' bash blocks run forked from a server that imported ``preload`` once (for the
    subcommands of ``by_subcommand``, their modules instead, unless the arguments hold one of ``plain_flags``,
    e.g. ``--help``). List only modules the command imports anyway on a cold start: then the command runs as it
    would cold, its imports done beforehand (tests/docs/warm_server.py says what is kept). ``script`` defaults
    to the virtual environment's script of that name. ``DOCS_WARM=0`` runs everything cold."""

    name: str
    preload: tuple[str, ...]
    by_subcommand: tuple[tuple[str, tuple[str, ...]], ...] = ()
    plain_flags: frozenset[str] = frozenset()
    script: Path | None = None

    @property
    def path(self) -> Path:
        return self.script if self.script is not None else Path(sys.executable).parent / self.name

    def named_in(self, code: str) -> bool:
        return re.search(rf"(?<![\w./-]){re.escape(self.name)}(?![\w.-])", code) is not None

    def tiers(self) -> dict[str, tuple[str, ...]]:
        """Subcommand -> modules to preload, ``""`` for every other call."""
        return {"": self.preload, **dict(self.by_subcommand)}


_SHIM = """#!{python} -IS
# The stand-in for {script} in the documentation's blocks (tests/docs/warm_server.py): runs it forked from a
# warm server, passes on every signal, ends as the command ended; runs it cold where no server answers.
import json, os, signal, socket, sys

SCRIPT = {script!r}
SOCKETS = {sockets!r}
PLAIN = {plain!r}
pid, pending = None, []


def forward(sig, frame):
    if pid is None:
        pending.append(sig)
        return
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


for name in {forwarded!r}:
    signal.signal(getattr(signal, name), forward)
args = sys.argv[1:]
tier = args[0] if args and args[0] in SOCKETS and not PLAIN & set(args) else ""
first = []
try:
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(SOCKETS[tier])
    request = {{"argv": sys.argv, "cwd": os.getcwd(), "env": dict(os.environ)}}
    socket.send_fds(conn, [json.dumps(request).encode() + b"\\n"], [0, 1, 2])
    answers = conn.makefile("rb")
    first = answers.readline().split()
except OSError:
    pass
if first[:1] != [b"pid"]:
    for sig in pending:
        signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
    os.execv(SCRIPT, [SCRIPT, *args])
pid = int(first[1])
for sig in pending:
    forward(sig, None)
last = answers.readline().split()
if not last:
    sys.exit(f"{{os.path.basename(SCRIPT)}}: its warm server went away before it ended")
if last[0] == b"signal":
    number = int(last[1])
    signal.signal(number, signal.SIG_DFL)
    os.kill(os.getpid(), number)
    sys.exit(128 + number)
sys.exit(int(last[1]))
"""


@dataclass
class _WarmSet:
    """The servers and shims of some warm commands under one environment: started once per test process (the
    imports are what they save), stopped when it exits."""

    page_env: dict[str, str]
    servers: list[subprocess.Popen[bytes]]


_WARM_SETS: dict[object, _WarmSet] = {}
_WARM_ROOT: list[Path] = []


def _warm_root() -> Path:
    if not _WARM_ROOT:
        _WARM_ROOT.append(Path(tempfile.mkdtemp(prefix="docs-warm-")))
        atexit.register(_stop_warm)
    return _WARM_ROOT[0]


def _stop_warm() -> None:
    for warm in _WARM_SETS.values():
        for server in warm.servers:
            kill_group(server)
    _WARM_SETS.clear()
    for root in _WARM_ROOT:
        shutil.rmtree(root, ignore_errors=True)
    _WARM_ROOT.clear()


def warm_set(commands: tuple[WarmCommand, ...], env: Mapping[str, str]) -> _WarmSet:
    key = (commands, frozenset((k, v) for k, v in env.items() if k not in _UNCHECKED))
    if key in _WARM_SETS:
        return _WARM_SETS[key]
    folder = Path(tempfile.mkdtemp(prefix="set-", dir=_warm_root()))
    page_env = {**env, "PATH": os.pathsep.join([str(folder / "bin"), env.get("PATH", "")])}
    (folder / "bin").mkdir()
    servers: dict[str, subprocess.Popen[bytes]] = {}
    for c, command in enumerate(commands):
        sockets = {}
        for t, (tier, modules) in enumerate(command.tiers().items()):
            address = sockets[tier] = str(folder / f"{c}-{t}.sock")
            with (folder / f"{c}-{t}.log").open("wb") as log:
                servers[address] = subprocess.Popen(
                    [sys.executable, str(WARM_SERVER), address, str(command.path), *modules],
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=log,
                    cwd=folder,
                    env=page_env,
                    start_new_session=True,
                )
        shim = folder / "bin" / command.name
        shim.write_text(
            _SHIM.format(
                python=sys.executable,
                script=str(command.path),
                sockets=sockets,
                plain=set(command.plain_flags),
                forwarded=_FORWARDED,
            )
        )
        shim.chmod(0o755)
    # Each server listens before its imports, so a shim that connects waits for them rather than running cold
    # (a server that cannot start leaves its commands cold: slower, as correct).
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if all(Path(address).exists() or server.poll() is not None for address, server in servers.items()):
            break
        time.sleep(0.02)
    _WARM_SETS[key] = _WarmSet(page_env, list(servers.values()))
    return _WARM_SETS[key]

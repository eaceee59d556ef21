"""`python -m experiments NAME ...` runs forked from one process that has already imported what
every script imports first (jax and cbjax: about 1 s of the 1.2 s a run that stops at a bad flag
takes). Each run is its own process, as from a shell: a fresh `__main__`, its own flags, stdout
and stderr, and an exit code; only the interpreter's start and those imports are shared."""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import tempfile

_FORK_SERVER = r"""
import json, os, runpy, sys, traceback
import jax, cbjax  # noqa: F401

for line in sys.stdin:
    args, out_path, err_path = json.loads(line)
    pid = os.fork()
    if pid == 0:
        for fd, path in ((1, out_path), (2, err_path)):
            os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
        sys.argv, code = ["experiments", *args], 0
        try:
            runpy.run_module("experiments", run_name="__main__", alter_sys=True)
        except SystemExit as stop:
            code = stop.code if isinstance(stop.code, int) else 0 if stop.code is None else 1
            if isinstance(stop.code, str):
                print(stop.code, file=sys.stderr)
        except BaseException:
            traceback.print_exc()
            code = 1
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    print(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), flush=True)
"""


class ForkedRuns:
    """`run(name, *flags)` -> `subprocess.CompletedProcess` of `python -m experiments name flags`
    in `cwd`. POSIX only (fork)."""

    def __init__(self, cwd: str):
        self._server = subprocess.Popen([sys.executable, "-c", _FORK_SERVER], cwd=cwd, stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, text=True)
        self._folder = tempfile.TemporaryDirectory(prefix="cbjax-forked-")

    def run(self, name: str, *flags: str, timeout: float = 120) -> subprocess.CompletedProcess:
        out, err = (os.path.join(self._folder.name, stream) for stream in ("stdout", "stderr"))
        args = [name.removesuffix(".py"), *flags]
        self._server.stdin.write(json.dumps([args, out, err]) + "\n")
        self._server.stdin.flush()
        if not select.select([self._server.stdout], [], [], timeout)[0]:
            self.close()
            raise subprocess.TimeoutExpired(args, timeout)
        line = self._server.stdout.readline()
        if not line:
            raise RuntimeError(f"the fork server exited (code {self._server.wait()})")
        with open(out, encoding="utf-8") as stdout, open(err, encoding="utf-8") as stderr:
            return subprocess.CompletedProcess(args, int(line), stdout.read(), stderr.read())

    def close(self) -> None:
        self._server.stdin.close()
        self._server.kill()
        self._server.wait()
        self._folder.cleanup()

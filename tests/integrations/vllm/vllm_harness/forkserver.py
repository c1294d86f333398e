"""Fork server of the real-vLLM tests (runs in vLLM's own venv): vLLM is imported once per
test session, and every harness run is a fresh process forked from here.

Importing torch, vLLM and the connector costs a harness process about 12 s of CPU on the
test machine (2 cores), a third to a half of a short replica run; a session runs some
thirty such processes.  ``python -m tests.integrations.vllm.vllm_harness.forkserver``
imports them and then serves one JSON request per stdin line:

- ``{"module": M, "argv": [...], "log": PATH, "env": {...}, "cwd": DIR}``: fork a child
  that runs ``python -m M ARGV...`` (``runpy``, as ``__main__``) in a process group of its
  own, with ``env`` as its whole environment and stdout and stderr in ``PATH``; answered
  at once with ``{"pid": PID}``;
- when a child exits: ``{"pid": PID, "rc": CODE}`` (a signal's negative number).

A child is a fresh process as far as the tests can tell: no engine, no connector, no
daemon client was ever built in this server (it only imports), so replica B is still a
process that never stored what it loads.  This server never runs anything itself; it
exits when its stdin closes.
"""

from __future__ import annotations

import json
import os
import runpy
import select
import sys
import traceback
from typing import Any

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")


def _preload() -> None:
    """What every harness imports first (the modules only: nothing is built)."""
    import torch  # noqa: F401
    import transformers  # noqa: F401
    from vllm import LLM, SamplingParams  # noqa: F401
    from vllm.config import KVTransferConfig  # noqa: F401
    from vllm.inputs import TokensPrompt  # noqa: F401

    import lmcache_client.integrations.vllm.connector  # noqa: F401


def _child(request: dict[str, Any]) -> int:
    """In the forked child: become ``python -m MODULE ARGV...``; its exit code."""
    os.setpgid(0, 0)
    log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    os.close(null)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request.get("cwd", os.getcwd()))
    sys.argv = [request["module"], *request["argv"]]
    try:
        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
        return 0
    except SystemExit as done:
        code = done.code
        if code is None or isinstance(code, int):
            return code or 0
        print(code, file=sys.stderr)
        return 1
    except BaseException:
        traceback.print_exc()
        return 1


def _fork(request: dict[str, Any]) -> int:
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            code = _child(request)
            import atexit

            atexit._run_exitfuncs()  # what a normal interpreter exit runs (vLLM's shutdown hooks)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    try:
        os.setpgid(pid, pid)  # as the child does: whichever runs first, a kill of the group reaches it
    except OSError:  # the child has exec'd or exited already
        pass
    return pid


def _reply(message: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def _reap(children: set[int]) -> None:
    for pid in list(children):
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            children.discard(pid)
            _reply({"pid": pid, "rc": os.waitstatus_to_exitcode(status)})


def main() -> int:
    _preload()
    _reply({"ready": True})
    children: set[int] = set()
    pending = b""
    stdin = sys.stdin.fileno()
    while True:
        readable, _, _ = select.select([stdin], [], [], 0.05)
        if readable:
            data = os.read(stdin, 65536)
            if not data:
                break
            pending += data
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                if line.strip():
                    pid = _fork(json.loads(line))
                    children.add(pid)
                    _reply({"pid": pid})
        _reap(children)
    for pid in children:  # stdin closed: the tests are over; wait for what still runs
        os.waitpid(pid, 0)
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)  # nothing to clean up: a normal exit would only tear torch and vLLM down (seconds)

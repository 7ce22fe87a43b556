"""Runs catalogue calls in worker processes (``worker.py``), each call isolated from a crash.

A few long-lived workers take calls one at a time (importing torch per call would cost ~2 s each).
When a worker dies (a segfault, an abort) or exceeds the per-call timeout, the call it was running
is reported as a crash or a hang, the worker is replaced, and the other calls go on.
"""

from __future__ import annotations

import json
import os
import selectors
import subprocess
import sys
import time
from pathlib import Path

WORKER = Path(__file__).with_name("worker.py")
STARTUP_TIMEOUT = 300.0  # importing torch and building the catalogue, on a loaded machine


class HarnessError(RuntimeError):
    """A worker could not even start: the harness is broken, no call is to blame."""


class _Worker:
    def __init__(self, env):
        self.proc = subprocess.Popen([sys.executable, str(WORKER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, bufsize=1, env=env)
        self.name = None
        self.started = 0.0
        os.set_blocking(self.proc.stderr.fileno(), False)
        self._wait_ready()

    def _wait_ready(self):
        """Block until the worker has imported everything: a call's timeout is the call's alone (the
        first H200 run reported selftest/abort as a hang: twelve workers importing CUDA torch at once
        took longer than its 8 s)."""
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            line = self.proc.stdout.readline() if sel.select(timeout=STARTUP_TIMEOUT) else ""
        if not line.strip().startswith('{"ready"'):
            self.proc.kill()
            self.proc.wait()
            raise HarnessError(f"an adversarial worker did not start within {STARTUP_TIMEOUT:.0f} s: "
                               f"{line!r} {self.stderr_tail()}")

    def send(self, name):
        self.name, self.started = name, time.monotonic()
        self.proc.stdin.write(name + "\n")
        self.proc.stdin.flush()

    def stderr_tail(self) -> str:
        try:
            return (self.proc.stderr.read() or "")[-1500:]
        except (OSError, ValueError):
            return ""

    def close(self):
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def run_calls(names: list[str], *, workers: int = 2, timeout: float = 60.0) -> dict[str, dict]:
    """``{name: {"verdict": "pass" | "fail", "detail": str}}`` for every name."""
    env = dict(os.environ)
    env.pop("KL_KERNELS_BACKEND", None)  # the catalogue names its backends itself
    pending = list(reversed(names))
    results: dict[str, dict] = {}
    pool = [_Worker(env) for _ in range(min(workers, max(1, len(names))))]
    selector = selectors.DefaultSelector()
    for w in pool:
        selector.register(w.proc.stdout, selectors.EVENT_READ, w)

    def feed(w):
        if pending:
            w.send(pending.pop())
        else:
            w.name = None

    def replace(w, verdict):
        results[w.name] = verdict
        selector.unregister(w.proc.stdout)
        w.proc.kill()
        w.proc.wait()
        fresh = _Worker(env)
        pool[pool.index(w)] = fresh
        selector.register(fresh.proc.stdout, selectors.EVENT_READ, fresh)
        feed(fresh)

    for w in pool:
        feed(w)
    while any(w.name is not None for w in pool):
        for key, _ in selector.select(timeout=1.0):
            w = key.data
            line = w.proc.stdout.readline()
            if not line:  # the worker died while running w.name
                code = w.proc.wait()
                replace(w, {"verdict": "fail", "detail": f"the process died (exit {code}) running this call: "
                                                         f"{w.stderr_tail()}"})
                continue
            msg = json.loads(line)
            results[msg["name"]] = {"verdict": msg["verdict"], "detail": msg["detail"]}
            feed(w)
        now = time.monotonic()
        for w in list(pool):
            if w.name is not None and now - w.started > timeout:
                replace(w, {"verdict": "fail", "detail": f"no answer within {timeout:.0f} s (hang)"})
    for w in pool:
        w.close()
    return results

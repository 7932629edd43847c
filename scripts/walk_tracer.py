"""The call recorder ``scripts/walk_request.py`` puts into every process of the stack it starts.

Copied as ``sitecustomize.py`` into a temp dir on PYTHONPATH, so Python imports it at start-up in
each process (launcher, gateway, prefill and decode workers) and the project needs no hook. It does
nothing unless ``DSV4_WALK_OUT`` names a directory. Then it installs a profile function in every
thread (``sys.setprofile`` here, ``threading.setprofile`` for threads started later: Python 3.11
has no all-threads switch) that returns at once until the marker file ``DSV4_WALK_OUT/on`` exists.
A poller thread (not profiled) looks for the marker every ``POLL_S`` seconds; while it exists, each
call into a project file (``DSV4_WALK_ROOT``/engine, kvtransfer, server) is kept as one event:

    (thread, callee file, callee qualname, caller file or None, step number or -1)

The caller is the nearest project frame up the stack, found through library frames (a model layer
reached through ``torch.nn.Module.__call__`` is called by the runner that called the model) but
not through the asyncio event loop: a coroutine resumed by the loop, or a thread's first call, has
no caller (an entry). A resumed generator or coroutine counts as a call, as the profiler sees it.
A call of ``DSV4_WALK_STEP`` ("file:qualname", the engine's step) and the events inside it
carry that call's number in the process. When the marker goes away the events are written, once, to
``DSV4_WALK_OUT/<pid>.json`` with the process's argv; each process also writes
``<pid>.argv.json`` at start so the walker knows whom to wait for.
"""
from __future__ import annotations

import asyncio
import json
import os
import sys
import threading
import time

POLL_S = 0.005                      # marker poll period, seconds


class Recorder:
    """Per-process state: the event list, the step being recorded per thread, the on/off flag."""

    def __init__(self, root: str, out: str, step: str):
        self.root = root.rstrip("/") + "/"
        self.prefixes = tuple(self.root + p + "/" for p in ("engine", "kvtransfer", "server"))
        self.loop_dir = os.path.dirname(asyncio.__file__) + "/"
        self.out = out
        self.step_file, _, self.step_name = step.partition(":")
        self.on = False
        self.events: list[tuple] = []
        self.names: dict[int, str] = {}
        self.steps: dict[int, tuple] = {}          # thread ident -> (frame of the step call, number)
        self.step_count = 0
        self._rel: dict[object, str | None] = {}   # code object -> project-relative file or None

    def rel(self, code) -> str | None:
        """The project-relative file of a code object, or None outside the project (cached)."""
        r = self._rel.get(code, "")
        if r == "":
            f = code.co_filename
            r = self._rel[code] = f[len(self.root):] if f.startswith(self.prefixes) else None
        return r

    def caller(self, frame) -> str | None:
        """The file of the nearest project frame calling ``frame``; None past the event loop or the top."""
        back = frame.f_back
        while back is not None:
            code = back.f_code
            if code.co_filename.startswith(self.loop_dir):
                return None
            r = self.rel(code)
            if r is not None:
                return r
            back = back.f_back
        return None

    def profile(self, frame, event, arg) -> None:
        """The ``sys.setprofile`` function: keeps project calls while on, tracks the step's frame."""
        if not self.on:
            return
        if event == "return":
            st = self.steps.get(threading.get_ident())
            if st is not None and st[0] is frame:
                del self.steps[threading.get_ident()]
            return
        if event != "call":
            return
        callee = self.rel(frame.f_code)
        if callee is None:
            return
        ident = threading.get_ident()
        if ident not in self.names:
            self.names[ident] = threading.current_thread().name
        st = self.steps.get(ident)
        name = getattr(frame.f_code, "co_qualname", frame.f_code.co_name)     # co_qualname: 3.11+
        if st is None and callee == self.step_file and name == self.step_name:
            st = self.steps[ident] = (frame, self.step_count)              # the step's own call is in it
            self.step_count += 1
        self.events.append((ident, callee, name, self.caller(frame), -1 if st is None else st[1]))

    def write(self) -> None:
        """Write the events to ``<out>/<pid>.json`` (atomically: the walker reads it as it appears)."""
        rows = [[self.names.get(t, str(t)), *rest] for t, *rest in self.events]
        path = os.path.join(self.out, f"{os.getpid()}.json")
        with open(path + ".tmp", "w") as f:
            json.dump({"pid": os.getpid(), "argv": sys.orig_argv, "events": rows}, f)
        os.replace(path + ".tmp", path)

    def poll(self) -> None:
        """Follow the marker file: on while it exists; when it goes away, write once and stop."""
        marker = os.path.join(self.out, "on")
        seen = False
        while True:
            self.on = os.path.exists(marker)
            seen = seen or self.on
            if seen and not self.on:
                self.write()
                return
            time.sleep(POLL_S)


def install() -> Recorder | None:
    """Start recording in this process if ``DSV4_WALK_OUT`` is set; returns the recorder."""
    out = os.environ.get("DSV4_WALK_OUT")
    if not out:
        return None
    rec = Recorder(os.environ["DSV4_WALK_ROOT"], out, os.environ.get("DSV4_WALK_STEP", ""))
    with open(os.path.join(out, f"{os.getpid()}.argv.json"), "w") as f:
        json.dump(sys.orig_argv, f)
    # started before the profile function is set for new threads: the poller is never recorded
    threading.Thread(target=rec.poll, name="walk-poller", daemon=True).start()
    sys.setprofile(rec.profile)
    threading.setprofile(rec.profile)
    return rec


if __name__ == "sitecustomize":
    RECORDER = install()

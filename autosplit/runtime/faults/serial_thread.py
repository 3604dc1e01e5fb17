"""A daemon thread that runs functions one at a time, in the order they were submitted.

Used where a blocking call must not block the calling thread (gloo's ``Work.wait``) or where calls
must run strictly one after another (the strict point-to-point transport).
"""
from __future__ import annotations

import queue
import threading
from concurrent.futures import Future


class SerialThread:
    """A daemon thread running submitted functions one at a time, in submission order.

    Daemon, and not a ThreadPoolExecutor, so that a function stuck on a dead peer cannot keep the
    process from exiting after the failure has been reported.
    """

    def __init__(self, name: str):
        self._tasks: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._loop, name=name, daemon=True).start()

    def submit(self, fn, *args) -> Future:
        future: Future = Future()
        self._tasks.put((future, fn, args))
        return future

    def close(self) -> None:
        """End the thread after the functions already submitted (it does not wait for them)."""
        self._tasks.put(None)

    def _loop(self) -> None:
        while True:
            task = self._tasks.get()
            if task is None:
                return
            future, fn, args = task
            try:
                future.set_result(fn(*args))
            except BaseException as exc:     # handed to whoever waits on the future
                future.set_exception(exc)

"""A fake NVSHMEM ops object for the bootstrap tests (unit and multirank); no GPU needed.

It logs every call, can be told to fail a given step, and calls ``on_collective(name)`` from
every call that is a collective in real NVSHMEM (init, malloc, free, barrier, finalize), so a test
can check that the module lock is not held there.
"""

import threading

import torch

from moe_ep.shim import nvshmem_boot

UID_LEN = 16
ROOT_UID = b"ROOT-UID-0123456"


def lock_is_free() -> bool:
    """True when this thread does not hold the bootstrap lock and another thread can take it."""
    if nvshmem_boot._LOCK._is_owned():
        return False
    got = []

    def grab():
        ok = nvshmem_boot._LOCK.acquire(timeout=2)
        got.append(ok)
        if ok:
            nvshmem_boot._LOCK.release()

    th = threading.Thread(target=grab)
    th.start()
    th.join(5)
    return got == [True]


class FakeOps:
    """``initialized``: status_initialized() answer (NVSHMEM initialised by someone else);
    ``fail``: name of a step that raises RuntimeError ("make_uid", "check_device", "init");
    ``on_collective``: callback run inside every collective call."""

    def __init__(self, initialized=False, fail=None, on_collective=None):
        self.initialized = initialized
        self.fail = fail
        self.on_collective = on_collective or (lambda name: None)
        self.log = []

    def _step(self, name):
        if self.fail == name:
            raise RuntimeError(f"fake {name} failure")

    def status_initialized(self):
        return self.initialized

    def check_device(self, device_index):
        self._step("check_device")

    def make_uid(self, root):
        self._step("make_uid")
        return ROOT_UID if root else b"\0" * UID_LEN

    def uid_to_bytes(self, uid):
        return bytes(uid)

    def uid_from_bytes(self, raw):
        return bytes(raw)

    def init(self, dev, uid, rank, nranks):
        self.on_collective("init")
        self.log.append(("init", dev, uid, rank, nranks))
        self._step("init")

    def finalize(self):
        self.on_collective("finalize")
        self.log.append(("finalize",))

    def tensor(self, shape, dtype):
        self.on_collective("tensor")
        self.log.append(("tensor", tuple(shape)))
        return torch.zeros(shape, dtype=dtype)

    def free(self, t):
        self.on_collective("free")
        self.log.append(("free", tuple(t.shape)))

    def peer(self, t, pe):
        return ("peer", pe)

    def barrier(self, stream):
        self.on_collective("barrier")
        self.log.append(("barrier",))

    def calls(self, name):
        return [e for e in self.log if e[0] == name]

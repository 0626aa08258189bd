"""Thread pools shared by every storage of a process, one per purpose and size."""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

_pools: dict[tuple[str, int], ThreadPoolExecutor] = {}
_lock = threading.Lock()


def shared_pool(name: str, workers: int) -> ThreadPoolExecutor:
    """The process's pool of ``workers`` threads named ``name`` (created on first use, kept for the process).

    Pools of different names never share threads: a task of one may wait for tasks of another (the engine's
    reads wait for the ranged requests they are split into) without taking the threads those need.
    """
    with _lock:
        pool = _pools.get((name, workers))
        if pool is None:
            pool = _pools[(name, workers)] = ThreadPoolExecutor(workers, thread_name_prefix=name)
        return pool

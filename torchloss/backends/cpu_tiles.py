"""CPU tiling and threading of the torch path: row tiles, compact tiles, a worker pool (no jaxloss twin: XLA tiles itself).

The torch path processes rows in tiles ``[R, V]`` sized to stay in a core's cache. On the CPU
the tiles are shared by a few worker threads that each run *single-threaded* ATen ops: no
OpenMP fork/join per op, a tile stays in one core's cache, and a core taken by another process
delays only its own tiles instead of stalling every parallel region at its barrier.

No process-wide side effects: ``torch.set_num_threads`` is not called (it sets a global that
every thread created afterwards inherits). Each worker lowers only its *own* OpenMP thread count
through the OpenMP runtime that torch loaded (``omp_set_num_threads`` is per thread), after
ATen's lazy per-thread initialisation. Where that runtime cannot be found the tiles run on the
calling thread. There is one pool per process, its size bounded by the number of cores; a call
uses ``min(torch.get_num_threads(), tiles, pool size)`` of its threads.

On a busy machine the pool keeps its size: bounding the workers by the cores that other
processes leave free (one worker at a load of 15-20 on 2 cores) measured 2-5x slower than two
workers, interleaved in one process (each worker then gets its own share of the cores). A lone
tile goes to a worker too (:func:`worker_count`). The fresh gradient is a plain ``torch.empty``:
a huge-page hint on it (``madvise(MADV_HUGEPAGE)``, tried until 2026-12-06) saved ~84 ms of page
faults per 512 MiB on an idle EPYC, but on a shared Xeon VM its 256 faults took more system
time than the 131072 4 KiB faults they replaced (330-371 against ~200 ms per call; 0.07-1.07 s
at a load of 8-15) and the step longer quiet and busy. See ``benchmarks/busy.py`` for the torch path against ``F.cross_entropy``
quiet and busy.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import os
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Generic, Optional, TypeVar

import numpy as np
import torch
from torch import Tensor

from lossspec import Tuning

# The default of lossspec.Tuning.cpu_tile_elements, the elements of one tile on the CPU (rows x
# vocabulary block): 2**20 fp32 = 4 MiB per buffer. Smaller tiles stay in a core's cache between
# the passes made over them but pay the per-op overhead of the small ATen ops once more per tile;
# 2**20 measured fastest on every kind (from 2**15 to 2**21).
DEFAULTS = Tuning(cpu_tile_elements=1 << 20)
# Off the CPU (CUDA): one tile runs ~20 kernel launches and their host overhead (~10 us each), so
# a tile must be large enough for each launch to move megabytes: 2**25 fp32 = 128 MiB per buffer.
# At 2**20 a 16384 x 131072 cross-entropy took 2048 tiles and 2 s on an H200 (the Triton kernel: 4 ms).
DEVICE_TILE_ELEMENTS: int = 1 << 25
# 16-bit logits on the CPU skip masked rows (compact tiles) once this fraction of rows is masked.
COMPACT_MIN_MASKED: float = 0.125
# The pool never has more threads than this (the cores of the machine).
MAX_WORKERS: int = max(1, os.cpu_count() or 1)

# A tile: rows [r0, r1) and, for a compact tile, the runs [a, b) of rows with coef != 0 inside
# it with their row indices, and the indices of its masked rows.
Tile = tuple[int, int, "tuple[list[tuple[int, int]], Tensor, Tensor] | None"]

T = TypeVar("T")


def cpu_tile_budget(tuning: Optional[Tuning]) -> int:
    """``tuning.cpu_tile_elements``, or its default (:data:`DEFAULTS`)."""
    return (tuning or DEFAULTS).cpu_tile_elements or DEFAULTS.cpu_tile_elements  # type: ignore[return-value]


def tile_elements(device: torch.device, buffers: int = 1, tuning: Optional[Tuning] = None) -> int:
    """Elements of one tile on ``device`` for a kind taking ``buffers`` scratch buffers: on the
    CPU ``tuning.cpu_tile_elements`` (:func:`cpu_tile_budget`), half that for 4 buffers or more;
    elsewhere :data:`DEVICE_TILE_ELEMENTS`.

    Two workers' buffers must share a 32 MiB L3: a pass-by-pass kernel over four 4 MiB buffers
    per worker ran 1.5x slower on two threads at 2**20 than at 2**19 (2-core EPYC). Jensen-Shannon
    keeps 5 buffers (2**19); soft CE and forward KL take 3 since they finish the teacher before
    the student (``torchloss._block``) and, with every other kind, keep 2**20: fewer tiles, and each tile's
    per-row ops run under the GIL (``torchloss.backends.torch.RowStats``).
    """
    if device.type != "cpu":
        return DEVICE_TILE_ELEMENTS
    budget = cpu_tile_budget(tuning)
    return budget if buffers < 4 else max(1, budget // 2)


def row_tiles(rows: int, tile_rows: int) -> list[Tile]:
    """Dense tiles of ``tile_rows`` rows (the last one ragged)."""
    return [(r0, min(rows, r0 + tile_rows), None) for r0 in range(0, rows, tile_rows)]


def compact_tiles(coef: Tensor, tile_rows: int) -> Optional[list[Tile]]:
    """Row tiles holding ``tile_rows`` *valid* rows each (16-bit logits on the CPU).

    16-bit logits are copied into an fp32 tile and the gradient copied back anyway; copying only
    the runs of valid rows costs nothing more and skips all work on masked rows, whose gradient
    rows are just zeroed. The valid rows are read on the host, which on the CPU is no
    synchronisation. ``None`` when few rows are masked.
    """
    live = (coef != 0).numpy()
    rows = live.shape[0]
    if rows == 0 or live.mean() > 1.0 - COMPACT_MIN_MASKED:
        return None
    index = torch.from_numpy(np.flatnonzero(live))
    edges = np.diff(np.concatenate(([0], live.astype(np.int8), [0])))
    runs = zip(np.flatnonzero(edges == 1).tolist(), np.flatnonzero(edges == -1).tolist())
    tiles: list[Tile] = []
    r0, taken, done, current = 0, 0, 0, []
    for a, b in runs:
        while a < b:
            step = min(b - a, tile_rows - taken)
            current.append((a, a + step))
            taken += step
            a += step
            if taken == tile_rows:
                tiles.append((r0, a, (current, index[done : done + taken], _masked(live, r0, a))))
                r0, done, taken, current = a, done + taken, 0, []
    if r0 < rows:
        tiles.append((r0, rows, (current, index[done : done + taken], _masked(live, r0, rows))))
    return tiles


def _masked(live: np.ndarray, r0: int, r1: int) -> Tensor:
    """Indices of the masked rows in ``[r0, r1)``."""
    return torch.from_numpy(np.flatnonzero(~live[r0:r1]) + r0)


class _Tiles(Generic[T]):
    """A thread-safe iterator over the tiles that the workers pull from: a worker whose core is
    busy with other work simply takes fewer tiles (dynamic scheduling)."""

    def __init__(self, tiles: Sequence[T]) -> None:
        self._tiles = iter(tiles)
        self._lock = threading.Lock()

    def __iter__(self) -> "_Tiles[T]":
        return self

    def __next__(self) -> T:
        with self._lock:
            return next(self._tiles)


def map_tiles(run: Callable[[Iterable[T]], None], tiles: Sequence[T], device: torch.device) -> None:
    """``run(tiles)`` on the CPU worker threads sharing one tile queue, or on this thread (off the
    CPU, or where the caller runs torch single-threaded anyway)."""
    workers = worker_count(device, len(tiles))
    if workers == 0:
        run(tiles)
        return
    queue = _Tiles(tiles)
    pool = _pool()
    for future in [pool.submit(run, queue) for _ in range(workers)]:
        future.result()


def worker_count(device: torch.device, n_tiles: int) -> int:
    """How many worker threads run the tiles: as many as the caller's ``torch.get_num_threads()``,
    the tiles and the pool allow on the CPU; 0 (the calling thread) off the CPU, without tiles,
    where the OpenMP runtime is not found, or where the caller runs torch single-threaded.

    A single tile goes to one worker too: on the calling thread its ~45 small ATen ops would each
    be an OpenMP parallel region, and on a busy CPU each region's barrier waits for a descheduled
    OpenMP thread (256 x 4096 cross-entropy beside 2 spinners on 2 cores: 7 ms there against 3 ms
    single-threaded; quiet, both 3 ms)."""
    threads = torch.get_num_threads()
    if device.type != "cpu" or n_tiles < 1 or threads <= 1 or omp_set_num_threads() is None:
        return 0
    return max(1, min(threads, n_tiles, MAX_WORKERS))


_POOL: Optional[tuple[int, concurrent.futures.ThreadPoolExecutor]] = None
_POOL_LOCK = threading.Lock()
_OMP: list = []  # [the runtime's omp_set_num_threads or None], resolved once


def omp_set_num_threads() -> Optional[Callable[[int], None]]:
    """``omp_set_num_threads`` of the OpenMP runtime torch loaded, or ``None``."""
    if not _OMP:
        found = None
        if torch.__config__.parallel_info().find("ATen parallel backend: OpenMP") >= 0:
            try:
                with open("/proc/self/maps") as maps:
                    paths = {line.split()[-1] for line in maps if "omp" in line.rsplit("/", 1)[-1] and ".so" in line}
                for path in sorted(paths):
                    lib = ctypes.CDLL(path)
                    if hasattr(lib, "omp_set_num_threads"):
                        found = lib.omp_set_num_threads
                        break
            except OSError:
                found = None
        _OMP.append(found)
    return _OMP[0]


def _single_threaded_worker() -> None:
    """Pool thread initializer: this thread's ATen ops run on this thread only. ATen reads the
    global thread count once per thread (lazily, on first use): trigger that first, then lower
    this thread's OpenMP count, which nothing else reads."""
    torch.get_num_threads()
    setter = omp_set_num_threads()
    if setter is not None:
        setter(1)


def _pool() -> concurrent.futures.ThreadPoolExecutor:
    """The process's worker pool (threads start lazily, at most :data:`MAX_WORKERS`). A forked
    child (a DataLoader worker) does not inherit the parent's threads and makes its own."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None or _POOL[0] != os.getpid():
            pool = concurrent.futures.ThreadPoolExecutor(
                max_workers=MAX_WORKERS, thread_name_prefix="torchloss", initializer=_single_threaded_worker
            )
            _POOL = (os.getpid(), pool)
        return _POOL[1]


def scale_rows_(grad: Tensor, factor: Tensor, tuning: Optional[Tuning] = None) -> Tensor:
    """``grad *= factor`` in place, ``factor`` ``[N, 1]`` (per row) in the compute dtype: the
    product is formed in the compute dtype and rounded once to ``grad``'s dtype.

    On the CPU a 16-bit ``grad`` goes tile by tile through the worker pool (upcast, multiply,
    round): the same numbers as ``grad.mul_(factor)``, whose mixed-dtype broadcast is ~10x
    slower there. Tiles of ``tuning.cpu_tile_elements`` (:func:`cpu_tile_budget`).
    """
    acc = factor.dtype
    if grad.device.type != "cpu" or grad.dtype == acc or grad.dim() != 2 or grad.numel() == 0:
        return grad.mul_(factor)
    rows, vocab = grad.shape
    tile_rows = max(1, min(rows, cpu_tile_budget(tuning) // max(vocab, 1)))

    def run(part: Iterable[Tile]) -> None:
        buf = torch.empty(tile_rows * vocab, dtype=acc)
        for r0, r1, _ in part:
            tile = buf[: (r1 - r0) * vocab].view(r1 - r0, vocab)
            tile.copy_(grad[r0:r1]).mul_(factor[r0:r1])
            grad[r0:r1].copy_(tile)

    map_tiles(run, row_tiles(rows, tile_rows), grad.device)
    return grad

"""Test helper: run a function on ``world`` torch.distributed processes (gloo on the CPU, or NCCL) and collect
what each rank returns (tests/test_ep_torch.py, test_layer_2026.py, test_layer_gpt_oss.py)."""

from __future__ import annotations

import json
import socket
import time

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_ranks(worker, world: int, args: tuple, out_path, timeout_s: float = 240.0) -> list:
    """``worker(rank, world, init_method, *args)`` in ``world`` spawned processes; every rank's result as written by
    :func:`gather_to_file` (rank 0) to ``out_path``. The processes are killed and the test fails after ``timeout_s``
    (a collective deadlocked?); a rank's exception is raised here with its traceback."""
    import torch.multiprocessing as mp

    ctx = mp.start_processes(worker, args=(world, f"tcp://127.0.0.1:{free_port()}", *args), nprocs=world, join=False,
                             start_method="spawn")
    deadline = time.monotonic() + timeout_s
    while not ctx.join(timeout=1.0):  # raises ProcessRaisedException with the rank's traceback
        if time.monotonic() > deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            pytest.fail(f"EP processes still running after {timeout_s:.0f} s (a collective deadlocked?)")
    with open(out_path) as f:
        return json.load(f)


def gather_to_file(mine, rank: int, world: int, out_path: str) -> None:
    """All ranks' ``mine`` gathered; rank 0 writes the list to ``out_path`` (JSON)."""
    import torch.distributed as dist

    gathered = [None] * world
    dist.all_gather_object(gathered, mine)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(gathered, f, indent=1)
    # every rank past its last collective before any tears its process group down: a rank destroying gloo's pairs
    # while a peer still uses them can abort that peer ("terminate called without an active exception")
    dist.barrier()

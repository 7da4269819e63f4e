"""A program written against cupyx.distributed's documented API; only the import differs.

    from cupyx.distributed import init_process_group   # cupyx
    from gridcomm import init_process_group            # gridcomm

Run it with `gridcomm launch --nproc 2 examples/cupyx_style.py` (GPUs) or with
`--backend host` (NumPy arrays, no GPU). Rank and world size come from the launcher's
environment, as cupyx programs usually take them from their own launcher.
"""

import os

from gridcomm import init_process_group

rank = int(os.environ["GRIDCOMM_RANK"])
n_devices = int(os.environ["GRIDCOMM_WORLD_SIZE"])

try:
    import cupy as xp

    xp.cuda.runtime.getDeviceCount()
except Exception:  # no GPU: the same calls on NumPy arrays through the host backend
    import numpy as xp

comm = init_process_group(n_devices, rank)

# all_reduce(in_array, out_array, op='sum', stream=None)
x = xp.arange(6, dtype=xp.float32) + rank
y = xp.empty_like(x)
comm.all_reduce(x, y, 'sum')
expected = sum(xp.arange(6, dtype=xp.float32) + r for r in range(n_devices))
assert bool((y == expected).all()), (y, expected)

# broadcast(in_out_array, root=0, stream=None)
z = xp.full(3, 42.0 if rank == 0 else 0.0)
comm.broadcast(z, 0)
assert bool((z == 42.0).all())

# send / recv between neighbours, reduce to the root, and a barrier.
if n_devices > 1:
    if rank == 0:
        comm.send(x, 1)
    elif rank == 1:
        got = xp.empty_like(x)
        comm.recv(got, 0)
        assert bool((got == xp.arange(6, dtype=xp.float32)).all())
out = xp.empty_like(x)
comm.reduce(x, out, 0, 'max')
if rank == 0:
    assert bool((out == xp.arange(6, dtype=xp.float32) + n_devices - 1).all())
comm.barrier()
print(f"rank {rank}: cupyx-style program ok", flush=True)
comm.stop()

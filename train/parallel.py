"""Data parallelism: a 1-D device mesh and the shard_map'd training step.

Works on 1..N local devices; for several hosts call :func:`init_distributed`
first (``jax.distributed.initialize``), then every process builds the same mesh
over ``jax.devices()``.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

DATA_AXIS = "data"


def init_distributed(coordinator: str | None, num_processes: int | None, process_id: int | None) -> None:
    """``jax.distributed.initialize`` when a coordinator address is given (multi-host runs) and this process
    has not joined yet (so that one process may call :func:`train.loop.train` more than once)."""
    if coordinator and not jax.distributed.is_initialized():
        jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes,
                                   process_id=process_id)


def make_mesh(num_devices: int | None = None) -> Mesh:
    """A ("data",) mesh over the first ``num_devices`` devices (all by default)."""
    devices = jax.devices()
    n = len(devices) if num_devices is None else num_devices
    if n < 1 or n > len(devices):
        raise ValueError(f"num_devices must be in 1..{len(devices)}, got {num_devices}")
    if jax.process_count() > 1 and n != len(devices):
        raise ValueError(f"num_devices must be all {len(devices)} devices of the {jax.process_count()} processes "
                         f"(every process feeds its own devices), got {num_devices}")
    return Mesh(np.array(devices[:n]), (DATA_AXIS,))


def data_parallel(step_fn: Callable, mesh: Mesh) -> Callable:
    """Wrap ``step_fn(params, opt_state, batch) -> (params, opt_state, metrics)`` for the mesh.

    The batch (accum, global_batch, seq+1) is split over its second axis; params and
    optimizer state are replicated; ``step_fn`` must ``pmean`` its gradients and
    metrics over :data:`DATA_AXIS`. The Pallas kernels run inside (interpret mode
    needs ``check_vma=False``).
    """
    sharded = jax.shard_map(step_fn, mesh=mesh, in_specs=(P(), P(), P(None, DATA_AXIS)),
                            out_specs=(P(), P(), P()), check_vma=False)
    return jax.jit(sharded, donate_argnums=(0, 1))


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Where a (accum, global batch, seq + 1) token batch lives: its batch axis split over the mesh."""
    return NamedSharding(mesh, P(None, DATA_AXIS))

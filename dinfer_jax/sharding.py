"""Device meshes ("data", "expert", "model"), the ONE table of logical-axis rules (LOGICAL_RULES),
activation shardings, multi-host init. Imports no model (param placement: models/placement.py).
Dims that must split evenly (experts, query heads, FFN) raise ShardingError when the mesh does not
divide them; the others stay replicated. Rules: docs/internals/runtime.md, docs/architecture.md.
"""
from __future__ import annotations

import math
import os
from typing import Iterable

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

MESH_AXES = ("data", "expert", "model")

# logical name -> mesh axes it may be split over, in order (None: always replicated).
LOGICAL_RULES: dict[str, tuple[str, ...] | None] = {
    "batch": ("data", "expert"),  # attention is data parallel over the expert axis too, when B divides
    "length": None,
    "embed": None,
    "heads": ("model",),
    "kv_heads": ("model",),  # replicated when TP > K (GQA)
    "head_dim": None,
    "mlp": ("model",),
    "expert": ("expert",),
    "expert_logits": None,  # the router (D, E) is replicated: routing is computed in fp32 everywhere
    "vocab": ("model",),
    "layers": None,
}
# Params on these logical axes must split evenly over their mesh axes (else: ShardingError).
STRICT = frozenset({"heads", "mlp", "expert"})


class ShardingError(ValueError):
    """The mesh does not fit the model or the inputs (sizes that do not divide, bad mesh spec)."""


# ----------------------------------------------------------------------------------- meshes
def parse_mesh_spec(spec: str | dict | None) -> dict[str, int]:
    """"data=2,expert=4" (or a dict) -> {"data": 2, "expert": 4, "model": 1}."""
    if spec is None or spec == "":
        return {a: 1 for a in MESH_AXES}
    if isinstance(spec, str):
        items = {}
        for part in spec.replace(" ", "").split(","):
            if not part:
                continue
            name, eq, val = part.partition("=")
            if not eq:
                raise ShardingError(f"mesh spec {spec!r}: expected axis=size items like 'data=2,expert=4'")
            try:
                items[name] = int(val)
            except ValueError:
                raise ShardingError(f"mesh spec {spec!r}: size of {name!r} is not an integer") from None
        spec = items
    unknown = sorted(set(spec) - set(MESH_AXES))
    if unknown:
        raise ShardingError(f"mesh spec names unknown axes {unknown}; the axes are {MESH_AXES}")
    sizes = {a: int(spec.get(a, 1)) for a in MESH_AXES}
    if sum(v == -1 for v in sizes.values()) > 1 or any(v == 0 or v < -1 for v in sizes.values()):
        raise ShardingError(f"mesh spec {spec}: sizes must be positive (at most one -1 = the remaining devices)")
    return sizes


def make_mesh(spec: str | dict | None = None, devices: Iterable | None = None) -> Mesh:
    """A ("data", "expert", "model") mesh over all devices (of every process) with Auto axes."""
    devices = list(jax.devices() if devices is None else devices)
    sizes = parse_mesh_spec(spec)
    if -1 in sizes.values():
        known = math.prod(v for v in sizes.values() if v != -1)
        if len(devices) % known:
            raise ShardingError(f"mesh {sizes}: {len(devices)} devices are not a multiple of {known}")
        sizes = {a: (len(devices) // known if v == -1 else v) for a, v in sizes.items()}
    n = math.prod(sizes.values())
    if n != len(devices):
        raise ShardingError(f"mesh {sizes} needs {n} devices but {len(devices)} are available "
                            f"(use -1 for one axis to take the rest)")
    shape = tuple(sizes[a] for a in MESH_AXES)
    auto = (jax.sharding.AxisType.Auto,) * len(MESH_AXES)
    return jax.make_mesh(shape, MESH_AXES, axis_types=auto, devices=devices)


def mesh_summary(mesh: Mesh | None) -> str:
    if mesh is None:
        return "single device"
    return ",".join(f"{a}={mesh.shape[a]}" for a in MESH_AXES)


# ------------------------------------------------------------------------- logical -> mesh
def logical_spec(axes: tuple, shape: tuple, mesh: Mesh, strict: bool = False, what: str = "array") -> P:
    """PartitionSpec for an array with one logical name per dim; strict=True: ShardingError when a dim on
    a STRICT axis cannot take all its mesh axes (docs/internals/runtime.md)."""
    if len(axes) != len(shape):
        raise ShardingError(f"{what}: {len(axes)} logical axes {axes} for a rank-{len(shape)} shape {shape}")
    used: set[str] = set()
    out = []
    for name, dim in zip(axes, shape):
        if name is not None and name not in LOGICAL_RULES:
            raise ShardingError(f"{what}: logical axis {name!r} has no rule in sharding.LOGICAL_RULES")
        picked, prod = [], 1
        for ax in (LOGICAL_RULES.get(name) or ()) if name else ():
            size = mesh.shape[ax]
            if size == 1 or ax in used:
                continue
            if dim % (prod * size) == 0:
                picked.append(ax)
                prod *= size
            elif strict and name in STRICT:
                raise ShardingError(f"{what}: dim {name!r} of size {dim} is not divisible by mesh axis "
                                    f"{ax!r} of size {size} (mesh {mesh_summary(mesh)})")
        used.update(picked)
        out.append(None if not picked else picked[0] if len(picked) == 1 else tuple(picked))
    return P(*out)


def batch_axes(batch: int, mesh: Mesh | None) -> tuple[str, ...]:
    """The mesh axes a batch of `batch` rows is split over (see LOGICAL_RULES["batch"])."""
    if mesh is None:
        return ()
    spec = logical_spec(("batch",), (batch,), mesh)[0]
    return () if spec is None else (spec,) if isinstance(spec, str) else tuple(spec)


def constrain(x, axes: tuple, mesh: Mesh | None):
    """Pin an activation's sharding by logical names; a no-op without a mesh."""
    if mesh is None:
        return x
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, logical_spec(axes, x.shape, mesh)))


# ------------------------------------------------------------------ host <-> global arrays
def to_global(x, sharding: NamedSharding):
    """A host array (the same full value on every process) -> a global jax.Array with `sharding`.
    Works on one or many processes (each process places only its addressable shards)."""
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])


def to_host(x) -> np.ndarray:
    """A (possibly multi-process) jax.Array -> numpy, gathering shards when needed."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        if x.is_fully_replicated:
            return np.asarray(x.addressable_data(0))
        from jax.experimental import multihost_utils
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


# ------------------------------------------------------------------------------ multi-host
def initialize_distributed(coordinator: str | None = None, num_processes: int | None = None,
                           process_id: int | None = None, local_device_count: int | None = None) -> bool:
    """jax.distributed.initialize from flags or the environment (DINFER_COORDINATOR / JAX_COORDINATOR_ADDRESS,
    DINFER_NUM_PROCESSES / JAX_NUM_PROCESSES, DINFER_PROCESS_ID / JAX_PROCESS_ID); False (nothing done)
    without a coordinator. On CPU, collectives use gloo."""
    env = os.environ.get
    coordinator = coordinator or env("DINFER_COORDINATOR") or env("JAX_COORDINATOR_ADDRESS")
    if not coordinator:
        return False
    n = num_processes if num_processes is not None else env("DINFER_NUM_PROCESSES") or env("JAX_NUM_PROCESSES")
    pid = process_id if process_id is not None else env("DINFER_PROCESS_ID") or env("JAX_PROCESS_ID")
    if n is None or pid is None:
        raise ShardingError("multi-host: --coordinator needs --num-processes and --process-id "
                            "(or DINFER_NUM_PROCESSES / DINFER_PROCESS_ID)")
    n, pid = int(n), int(pid)
    if not 0 <= pid < n:
        raise ShardingError(f"multi-host: process id {pid} is not in [0, {n})")
    if jax.config.jax_platforms in (None, "", "cpu") or os.environ.get("JAX_PLATFORMS", "") == "cpu":
        try:
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
        except Exception:  # older/newer jax without the option: its default CPU collectives apply
            pass
    kw = {}
    if local_device_count is not None:
        kw["local_device_ids"] = list(range(local_device_count))
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=n, process_id=pid, **kw)
    return True

"""`dinfer-jax plan`: compile the generate (or serving) programs for a Cloud TPU topology on any
host, with libtpu's compile-only devices (nothing runs, no TPU attached, no weights read).
The Plan's numbers, audits and mesh choice: docs/internals/runtime.md, docs/accelerators.md.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
import os
import re
import time

import jax
import jax.numpy as jnp
import numpy as np

from dinfer_jax import sharding as shd
from dinfer_jax.aot import MOSAIC_TPU, abstract_model, pallas_calls, segment_program_args
from dinfer_jax.config import ModelConfig
from dinfer_jax.models import placement
from dinfer_jax.engine import SamplingParams

TPU_EXTRA = "pip install -e '.[tpu]'"
GiB = 2**30


class PlanError(ValueError):
    """Bad plan input (topology, mesh, options) or no libtpu: one line for the user."""


class DoesNotFit(Exception):
    """XLA:TPU refused the program: it needs more HBM than the chip has (the compiler's message)."""


@dataclasses.dataclass(frozen=True)
class Chip:
    """A TPU generation's spec sheet, per chip: HBM bytes, HBM bytes/s, bf16 flops/s; devices per chip."""
    name: str
    hbm_bytes: int
    hbm_bytes_per_s: float
    bf16_flops_per_s: float
    devices_per_chip: int
    source: str


# Google Cloud's spec sheets (HBM capacity is given in GiB on the TPU7x page's comparison table).
CHIPS = {
    "TPU v5 lite": Chip("v5e", 16 * GiB, 819e9, 197e12, 1, "https://cloud.google.com/tpu/docs/v5e"),
    "TPU v6 lite": Chip("v6e", 32 * GiB, 1638e9, 918e12, 1, "https://cloud.google.com/tpu/docs/v6e"),
    "TPU v5": Chip("v5p", 95 * GiB, 2765e9, 459e12, 1, "https://cloud.google.com/tpu/docs/v5p"),
    "TPU7x": Chip("v7x", 192 * GiB, 7380e9, 2307e12, 2, "https://cloud.google.com/tpu/docs/tpu7x"),
}
# user-facing generation names -> libtpu's
ALIASES = {"v7x": "tpu7x", "v5litepod": "v5e"}
_TOPOLOGY_RE = re.compile(r"^([a-z0-9]+):(\d+(?:x\d+){1,2})$")


@dataclasses.dataclass(frozen=True)
class Topology:
    """A TPU topology's compile-only devices and its chip."""
    name: str
    devices: tuple
    chip: Chip

    @property
    def device_kind(self) -> str:
        return self.devices[0].device_kind

    @property
    def chips(self) -> int:
        return len(self.devices) // self.chip.devices_per_chip

    @property
    def hbm_bytes_per_device(self) -> int:
        return self.chip.hbm_bytes // self.chip.devices_per_chip

    @property
    def hbm_bytes_per_s_per_device(self) -> float:
        return self.chip.hbm_bytes_per_s / self.chip.devices_per_chip


def _libtpu_ready():
    """Compile-only TPU clients need libtpu and a CPU-only jax backend; PlanError otherwise."""
    try:
        import libtpu  # noqa: F401
    except ImportError:
        raise PlanError(f"compiling for TPU needs libtpu: {TPU_EXTRA}") from None
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")  # no metadata server: this host is not a TPU VM
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # other jax processes may hold libtpu's lock


def get_topology(name: str) -> Topology:
    """"v5e:2x2", "v6e:2x4", "v5p:2x2x1", "v7x:2x2x1" (= "tpu7x:2x2x1") -> Topology; PlanError
    for a malformed or unknown name. A topology smaller than one host gets one chip per host."""
    m = _TOPOLOGY_RE.match(name.strip().lower()) if isinstance(name, str) else None
    if not m:
        raise PlanError(f"topology {name!r}: expected GENERATION:SHAPE like v5e:2x2, v6e:2x4, v5p:2x2x1 or v7x:2x2x1")
    _libtpu_ready()
    from jax.experimental import topologies
    gen, shape = ALIASES.get(m.group(1), m.group(1)), m.group(2)
    full = f"{gen}:{shape}"
    try:
        try:
            topo = topologies.get_topology_desc(topology_name=full, platform="tpu")
        except Exception as e:  # smaller than a host (v5e:1x1): libtpu wants one chip per host
            if "chips_per_host_bounds" not in str(e):
                raise
            topo = topologies.get_topology_desc(topology_name=full, platform="tpu", chips_per_host_bounds=(1, 1, 1))
    except Exception as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise PlanError(f"topology {name!r} is not one libtpu knows ({first}); known generations: "
                        f"{', '.join(c.name for c in CHIPS.values())}") from None
    devices = tuple(topo.devices)
    chip = CHIPS.get(devices[0].device_kind)
    if chip is None:
        raise PlanError(f"topology {name!r}: no spec sheet for device kind {devices[0].device_kind!r} "
                        f"(known: {', '.join(c.name for c in CHIPS.values())})")
    return Topology(name, devices, chip)


def topology_mesh(topo: Topology, spec: str | dict | None):
    """A ("data", "expert", "model") mesh over the topology's devices (all data when spec is None)."""
    sizes = shd.parse_mesh_spec(spec) if spec else {"data": -1, "expert": 1, "model": 1}
    try:
        return shd.make_mesh(sizes, devices=topo.devices)
    except shd.ShardingError as e:
        raise PlanError(f"--mesh {spec}: {e} (topology {topo.name} has {len(topo.devices)} devices)") from None


def candidate_meshes(cfg: ModelConfig, topo: Topology) -> list[dict]:
    """Every data x expert x model split of the topology's devices that divides the model."""
    n = len(topo.devices)
    out = []
    for e, m in itertools.product(range(1, n + 1), repeat=2):
        if n % (e * m) or (e > 1 and not cfg.is_moe):
            continue
        sizes = {"data": n // (e * m), "expert": e, "model": m}
        try:
            placement.check_mesh_fits(cfg, topology_mesh(topo, sizes))
        except shd.ShardingError:
            continue
        out.append(sizes)
    return out


# ------------------------------------------------------------------------------ HLO reading
_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
                "s64": 8, "u64": 8, "f64": 8, "s4": 0.5, "u4": 0.5}
_SHAPE_RE = re.compile(r"\b([a-z]+[0-9]*(?:e[0-9]m[0-9][a-z]*)?)\[([0-9,]*)\]")
_INSTR_RE = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(\((?:[^()]|\([^()]*\))*\)|\S+)\s+([a-z][\w\-]*)\(")
_CALLED_RE = re.compile(r"(?:body|condition|calls|to_apply|true_computation|false_computation)=%?([\w.\-]+)")
_BRANCHES_RE = re.compile(r"branch_computations=\{([^}]*)\}")
COLLECTIVES = ("all-gather", "all-to-all", "all-reduce", "reduce-scatter", "collective-permute")


def shape_dims(type_str: str) -> list[tuple[tuple, float]]:
    """(dims, bytes per element) of every array shape in an HLO type string ("bf16[2,3]{1,0}" or a
    tuple of them)."""
    out = []
    for dt, dims in _SHAPE_RE.findall(type_str):
        size = _DTYPE_BYTES.get(dt, 1 if dt.startswith("f8") else None)
        if size is not None:
            out.append((tuple(int(d) for d in dims.split(",") if d), size))
    return out


def shape_bytes(type_str: str) -> list[int]:
    """Bytes of every array shape in an HLO type string."""
    return [int(math.prod(d) * size) for d, size in shape_dims(type_str)]


@dataclasses.dataclass(frozen=True)
class Instr:
    """One HLO instruction: its computation, name, result bytes (each array), opcode, and whether it
    runs inside a while loop (its computation is reachable from a while body or condition)."""
    computation: str
    name: str
    result_bytes: tuple
    opcode: str
    in_loop: bool
    text: str
    dims: tuple = ()  # each result array's dims


def hlo_instructions(text: str) -> list[Instr]:
    """The compiled module's instructions (compiled.as_text()), each marked in or out of a loop."""
    comps, calls, loop_roots, cur = {}, {}, set(), None
    for line in text.splitlines():
        if cur is None:  # a computation header: unindented, ends with "{"
            m = re.match(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$", line)
            if m and not line[:1].isspace() and not line.startswith("HloModule"):
                cur = m.group(1)
                comps[cur], calls[cur] = [], set()
            continue
        if line.strip() == "}":
            cur = None
            continue
        im = _INSTR_RE.match(line)
        if not im:
            continue
        comps[cur].append(im)
        called = set(_CALLED_RE.findall(line))
        for b in _BRANCHES_RE.findall(line):
            called.update(x.strip().lstrip("%") for x in b.split(","))
        calls[cur].update(called)
        if im.group(3) == "while":
            loop_roots.update(re.findall(r"(?:body|condition)=%?([\w.\-]+)", line))
    in_loop = _reachable(loop_roots, calls)
    return [Instr(c, im.group(1), tuple(shape_bytes(im.group(2))), im.group(3), c in in_loop, im.string,
                  tuple(d for d, _ in shape_dims(im.group(2)))) for c, ims in comps.items() for im in ims]


def _reachable(roots, calls: dict) -> set:
    seen, todo = set(), list(roots)
    while todo:
        c = todo.pop()
        if c not in seen:
            seen.add(c)
            todo.extend(calls.get(c, ()))
    return seen


def collectives(instrs: list[Instr]) -> dict:
    """{kind: {count, bytes}} of the collectives in the compiled HLO (static count: a loop body's
    once); bytes: each op's result (an async *-start: its largest array)."""
    out = {k: {"count": 0, "bytes": 0} for k in COLLECTIVES}
    for i in instrs:
        kind = i.opcode[:-len("-start")] if i.opcode.endswith("-start") else i.opcode
        if kind in out:
            out[kind]["count"] += 1
            out[kind]["bytes"] += (max(i.result_bytes, default=0) if i.opcode.endswith("-start")
                                   else sum(i.result_bytes))
    return out


def host_callbacks(instrs: list[Instr], in_loop_only: bool = True) -> int:
    """Host callbacks (custom calls whose target names a callback) and host transfers (send / recv
    with is_host_transfer) in the program (inside a loop only, by default)."""
    n = 0
    for i in instrs:
        if in_loop_only and not i.in_loop:
            continue
        if i.opcode == "custom-call" and re.search(r'custom_call_target="[^"]*callback[^"]*"', i.text):
            n += 1
        elif i.opcode in ("send", "recv", "send-done", "recv-done") and "is_host_transfer=true" in i.text:
            n += 1
    return n


def cache_copies(instrs: list[Instr], canvas: int, kv_heads: int, head_dim: int, layer_elems: int,
                 hidden_size: int = 0) -> list[Instr]:
    """`copy` ops (outside fusions) inside a loop whose result is KV-cache shaped (the rule:
    docs/internals/runtime.md, "TPU plans and AOT export")."""
    merged_min = layer_elems * (2 if kv_heads * head_dim == hidden_size else 1)

    def kv_shaped(d):  # the canvas dim, and K*H (or H and K) among the other dims
        if canvas not in d:
            return False
        rest = list(d)
        rest.remove(canvas)
        n = math.prod(d)
        if kv_heads * head_dim in rest and n >= merged_min:
            return True
        if head_dim not in rest or n < layer_elems:
            return False
        rest.remove(head_dim)
        return kv_heads in rest
    return [i for i in instrs if i.in_loop and i.opcode == "copy" and not i.computation.startswith("fused_")
            and any(kv_shaped(d) for d in i.dims)]


def largest(instrs: list[Instr], opcodes: tuple, in_loop_only: bool = False) -> int:
    """The largest result array (bytes) of the given opcodes (inside a loop only, if asked)."""
    return max((max(i.result_bytes, default=0) for i in instrs
                if (i.opcode in opcodes) and (i.in_loop or not in_loop_only)), default=0)


# ------------------------------------------------------------------------------ compiling
@dataclasses.dataclass
class Compiled:
    """One compiled program's numbers (per device)."""
    name: str
    arguments: int
    outputs: int
    aliased: int
    temp: int
    code: int
    flops: float
    bytes_accessed: float
    mosaic_calls: int
    interpreted: int
    seconds: float
    instrs: list

    @property
    def total(self) -> int:
        """Per-device bytes: arguments + outputs not aliased to an argument + temp + code."""
        return self.arguments + max(0, self.outputs - self.aliased) + self.temp + self.code


def compile_program(name: str, fn, args, static=()) -> Compiled:
    """jit(fn).lower(*args, *static).compile() on the args' devices -> Compiled."""
    t = time.perf_counter()
    lowered = fn.lower(*args, *static)
    try:
        compiled = lowered.compile()
    except jax.errors.JaxRuntimeError as e:
        if "RESOURCE_EXHAUSTED" in str(e) and "HBM" in str(e):
            raise DoesNotFit(f"{name}: " + " ".join(str(e).split("RESOURCE_EXHAUSTED:", 1)[-1].split())) from None
        raise
    seconds = time.perf_counter() - t
    ma = compiled.memory_analysis()
    ca = compiled.cost_analysis()
    ca = ca[0] if isinstance(ca, (list, tuple)) else (ca or {})
    text = compiled.as_text()
    calls = pallas_calls(fn.trace(*args, *static).jaxpr)
    return Compiled(name, ma.argument_size_in_bytes, ma.output_size_in_bytes, ma.alias_size_in_bytes,
                    ma.temp_size_in_bytes, ma.generated_code_size_in_bytes, float(ca.get("flops", 0.0)),
                    float(ca.get("bytes accessed", 0.0)), text.count(f'custom_call_target="{MOSAIC_TPU}"'),
                    sum(c["interpret"] for c in calls), seconds, hlo_instructions(text))


def shard_bytes(sds) -> int:
    """Bytes of one device's shard of a ShapeDtypeStruct (the whole array without a sharding)."""
    shape = sds.sharding.shard_shape(sds.shape) if sds.sharding is not None else sds.shape
    return int(math.prod(shape)) * np.dtype(sds.dtype).itemsize


@dataclasses.dataclass
class Plan:
    """One topology x mesh x program compile (see `as_json` for the fields)."""
    topology: Topology
    mesh: dict
    batch: int
    program_batch: int
    canvas_length: int
    programs: dict  # name -> Compiled
    param_bytes: int  # per device
    kv_bytes: int  # per device, K and V of every layer (0 without a cache)
    expert_stack_bytes: int  # one layer's full (unsharded) stack of one expert projection; 0 dense
    tpf: float
    layers: int
    kv_local_heads: int
    head_dim: int
    forward_flops: float  # whole forward, all devices: 2 x active params x program batch x window
    largest_batch: int | None = None
    hidden_size: int = 0  # D: a (B, L, D) activation copy looks like one layer's merged K when K*H == D
    pending: dict = dataclasses.field(default_factory=dict, repr=False)  # name -> (fn, args, static) to compile

    def compile(self) -> "Plan":
        """Compile the pending programs (DoesNotFit when XLA:TPU wants more HBM than the chip has)."""
        while self.pending:
            name, (fn, args, static) = next(iter(self.pending.items()))
            self.programs[name] = compile_program(name, fn, args, static)
            del self.pending[name]
        return self

    @property
    def main(self) -> Compiled:
        """The program whose memory decides the fit: the largest per-device total."""
        return max(self.programs.values(), key=lambda c: c.total)

    @property
    def fits(self) -> bool:
        return self.main.total <= self.topology.hbm_bytes_per_device

    def predicted(self) -> dict:
        """The floor: max(weight + KV-cache shard bytes / HBM bandwidth, 2 x active params x batch x window
        flops share / bf16 peak; attention scores not counted); bound names the larger."""
        topo = self.topology
        per_fwd = self.param_bytes + self.kv_bytes
        flops = self.forward_flops / len(topo.devices)
        t_mem = per_fwd / topo.hbm_bytes_per_s_per_device
        t_flops = flops / (topo.chip.bf16_flops_per_s / topo.chip.devices_per_chip)
        fps = 1.0 / max(t_mem, t_flops)
        return {"bytes_per_forward": per_fwd, "flops_per_forward": flops, "forwards_per_s": round(fps, 2),
                "bound": "memory" if t_mem >= t_flops else "compute", "tpf": self.tpf,
                "tokens_per_s": round(fps * self.batch * self.tpf, 1),
                "hbm_bytes_per_s": topo.hbm_bytes_per_s_per_device,
                "bf16_flops_per_s": topo.chip.bf16_flops_per_s / topo.chip.devices_per_chip, "source": topo.chip.source}

    def audits(self) -> dict:
        """Checks of the compiled HLO (all programs): no host callback inside a loop; no KV-cache-shaped
        copy inside the decoding loop (kv_copy_bytes sums them); no all-gather of a full expert stack."""
        instrs = [i for c in self.programs.values() for i in c.instrs]
        kv_layer = self.kv_bytes // (2 * self.layers)  # one layer's K (or V) shard
        big_gather = largest(instrs, ("all-gather", "all-gather-start"))
        kv = cache_copies(instrs, self.canvas_length, self.kv_local_heads, self.head_dim, kv_layer // 2,
                          self.hidden_size) \
            if self.kv_bytes else []
        return {
            "host_callbacks_in_loop": host_callbacks(instrs),
            "largest_copy_in_loop_bytes": largest(instrs, ("copy",), in_loop_only=True),
            "kv_copies_in_loop": len(kv),
            "kv_copy_bytes": sum(max(i.result_bytes) for i in kv),
            "kv_cache_in_place": not kv,
            "largest_all_gather_bytes": big_gather,
            "expert_stack_bytes": self.expert_stack_bytes,
            "no_full_expert_gather": self.expert_stack_bytes == 0 or big_gather < self.expert_stack_bytes,
        }

    def as_json(self) -> dict:
        m = self.main
        return {
            "compiled": True, "topology": self.topology.name, "device_kind": self.topology.device_kind,
            "chips": self.topology.chips, "devices": len(self.topology.devices), "mesh": self.mesh,
            "batch": self.batch, "program_batch": self.program_batch, "canvas_length": self.canvas_length,
            "programs": sorted(self.programs),
            "per_chip_bytes": {"arguments": m.arguments, "temp": m.temp, "code": m.code, "total": m.total},
            "hbm_bytes": self.topology.hbm_bytes_per_device, "fits": self.fits, "largest_batch": self.largest_batch,
            "mosaic_calls": sum(c.mosaic_calls for c in self.programs.values()),
            "interpreted": sum(c.interpreted for c in self.programs.values()),
            "collectives": collectives([i for c in self.programs.values() for i in c.instrs]),
            "flops": m.flops, "bytes_accessed": m.bytes_accessed,
            "compile_seconds": round(sum(c.seconds for c in self.programs.values()), 2),
            "predicted": self.predicted(), "audits": self.audits(),
        }


def _kv_bytes(cfg: ModelConfig, model, sampling: SamplingParams, batch: int, canvas: int) -> int:
    """Per-device bytes of the K and V caches (layers, B, L, K*H) the program keeps; 0 for cache none."""
    if sampling.cache == "none":
        return 0
    mesh = model.mesh
    b_split = math.prod(mesh.shape[a] for a in shd.batch_axes(batch, mesh))
    k_split = mesh.shape["model"] if cfg.num_kv_heads % mesh.shape["model"] == 0 else 1
    itemsize = np.dtype(model.module.dtype).itemsize
    return 2 * cfg.num_layers * (batch // b_split) * canvas * (cfg.num_kv_heads // k_split) * cfg.head_dim * itemsize


def prepare_plan(cfg: ModelConfig, topo: Topology, mesh_spec, *, batch: int = 1, prompt_len: int = 256,
                 sampling: SamplingParams | None = None, quantize: str | None = None, programs: str = "generate",
                 tpf: float = 1.0, dtype=jnp.bfloat16) -> Plan:
    """Everything of a plan but the compile: the model over abstract params on the topology's mesh,
    the programs' argument specs, per-device param / KV bytes and the floor (`Plan.predicted` needs
    no compile). `Plan.compile()` then runs XLA:TPU; `compile_plan` does both."""
    if programs not in ("generate", "serving"):
        raise PlanError(f"--programs {programs!r}: one of generate, serving")
    if batch <= 0 or prompt_len <= 0:
        raise PlanError(f"--batch {batch} and --prompt-len {prompt_len} must be positive")
    sampling = SamplingParams() if sampling is None else sampling
    mesh = topology_mesh(topo, mesh_spec)
    try:
        model = abstract_model(cfg, "tpu", dtype=dtype, mesh=mesh, quantize=quantize)
    except shd.ShardingError as e:
        raise PlanError(str(e)) from None
    if programs == "generate":
        prog, args, _, shape = model.generator.abstract_program(batch, prompt_len, sampling)
        todo = {"generate": (prog, args, ())}
        B, Lc = shape.batch, shape.canvas_length
    else:
        B = batch
        todo = segment_program_args(model, batch=batch, prompt_len=prompt_len, sampling=sampling)
        Lc = todo["init"][1][1].shape[1]
    params = model.abstract_params()
    param_bytes = sum(shard_bytes(x) for x in jax.tree_util.tree_leaves(params))
    expert = 0
    if cfg.is_moe:
        expert = cfg.num_experts * cfg.hidden_size * cfg.intermediate_size * np.dtype(dtype).itemsize
        if quantize is not None:
            expert //= np.dtype(dtype).itemsize
    return Plan(topo, {a: mesh.shape[a] for a in shd.MESH_AXES}, batch, B, Lc, {}, param_bytes,
                _kv_bytes(cfg, model, sampling, B, Lc), expert, tpf, cfg.num_layers,
                cfg.num_kv_heads // (mesh.shape["model"] if cfg.num_kv_heads % mesh.shape["model"] == 0 else 1),
                cfg.head_dim, 2.0 * cfg.num_active_params * B * (Lc if sampling.cache == "none" else
                                                                 sampling.block_length),
                hidden_size=cfg.hidden_size, pending=todo)


def compile_plan(cfg: ModelConfig, topo: Topology, mesh_spec, **kw) -> Plan:
    """Compile `programs` ("generate": the whole generate program; "serving": the continuous-batching
    init + segment programs) for `batch` prompts of `prompt_len` tokens on the topology's mesh
    (keywords as `prepare_plan`)."""
    return prepare_plan(cfg, topo, mesh_spec, **kw).compile()


def plan(cfg: ModelConfig, topology: str, mesh_spec=None, *, find_batch: bool = True, every_mesh: bool = True,
         **kw) -> dict:
    """Compile for the topology on `mesh_spec` (or choose, of the meshes that divide the model, the
    fitting one with the best floor) -> the chosen Plan's JSON plus "meshes" (one row each, saying why
    when left uncompiled); fits false and "reason" when none fits. find_batch: also the largest
    power-of-two batch that fits (from a compile at twice the batch). every_mesh: compile every mesh."""
    topo = get_topology(topology)
    meshes = [mesh_spec] if mesh_spec else candidate_meshes(cfg, topo)
    if not meshes:
        return {"compiled": False, "topology": topo.name, "device_kind": topo.device_kind, "chips": topo.chips,
                "fits": False, "reason": f"no data x expert x model mesh over {len(topo.devices)} devices divides "
                                         f"the model (experts, heads, FFN)"}
    prepared = [prepare_plan(cfg, topo, sizes, **kw) for sizes in meshes]
    if not every_mesh:
        prepared.sort(key=lambda p: -p.predicted()["tokens_per_s"])
    rows, plans = [], []
    for p in prepared:
        skip = None  # (fits, reason) of a mesh left uncompiled
        if not every_mesh and any(q.fits for q in plans):
            skip = None, "not compiled: a mesh with a better floor fits"
        elif not every_mesh and p.param_bytes > topo.hbm_bytes_per_device:
            skip = False, (f"not compiled: the param shard alone is {p.param_bytes / GiB:.2f} GiB per chip "
                           f"(HBM {topo.hbm_bytes_per_device / GiB:.2f} GiB)")
        if skip:
            rows.append({"mesh": p.mesh, "total": None, "fits": skip[0], "tokens_per_s": p.predicted()["tokens_per_s"],
                         "compile_seconds": None, "reason": skip[1]})
            continue
        try:
            p.compile()
        except DoesNotFit as e:
            rows.append({"mesh": p.mesh, "total": None, "fits": False, "tokens_per_s": None,
                         "compile_seconds": None, "reason": str(e)})
            continue
        plans.append(p)
        j = p.as_json()
        rows.append({"mesh": j["mesh"], "total": j["per_chip_bytes"]["total"], "fits": j["fits"],
                     "tokens_per_s": j["predicted"]["tokens_per_s"], "compile_seconds": j["compile_seconds"]})
    fitting = [p for p in plans if p.fits]
    if not fitting and not plans:  # XLA:TPU refused every mesh for want of HBM (or no shard fits)
        return {"compiled": False, "topology": topo.name, "device_kind": topo.device_kind, "chips": topo.chips,
                "mesh": None, "per_chip_bytes": None, "hbm_bytes": topo.hbm_bytes_per_device, "fits": False,
                "mosaic_calls": None, "collectives": None, "flops": None, "bytes_accessed": None,
                "compile_seconds": None, "predicted": None, "meshes": rows,
                "reason": f"no mesh of {topo.name} fits: " + "; ".join(
                    f"{_mesh_text(r['mesh'])}: {r['reason']}" for r in rows)}
    best = (max(fitting, key=lambda p: p.predicted()["tokens_per_s"]) if fitting
            else min(plans, key=lambda p: p.main.total))
    if find_batch and fitting:
        best.largest_batch = _largest_batch(cfg, topo, best, **kw)
    out = best.as_json()
    out["meshes"] = rows
    if not fitting:
        out["reason"] = (f"needs {out['per_chip_bytes']['total'] / GiB:.2f} GiB per chip on the smallest mesh "
                         f"({_mesh_text(best.mesh)}), the chip has {topo.hbm_bytes_per_device / GiB:.2f} GiB")
    return out


def _largest_batch(cfg, topo: Topology, p: Plan, **kw) -> int:
    """The largest power-of-two multiple of the data axis whose per-chip total, linear in the batch
    from compiles at p's program batch and twice it, stays within HBM."""
    kw = {**kw, "batch": 2 * p.program_batch}
    try:
        q = compile_plan(cfg, topo, p.mesh, **kw)
    except DoesNotFit:
        return p.program_batch
    per_row = max(1.0, (q.main.total - p.main.total) / (q.program_batch - p.program_batch))
    fixed = p.main.total - per_row * p.program_batch
    most = int((topo.hbm_bytes_per_device - fixed) // per_row)
    b = p.program_batch
    while 2 * b <= most:
        b *= 2
    return b


def _mesh_text(mesh: dict) -> str:
    return ",".join(f"{a}={mesh[a]}" for a in shd.MESH_AXES)


def format_table(out: dict) -> str:
    """A human-readable summary of `plan`'s JSON."""
    gib = lambda b: f"{b / GiB:.2f}"
    lines = []
    if out.get("meshes") and (len(out["meshes"]) > 1 or not out.get("compiled")):
        lines.append("| mesh | GiB per chip | fits | predicted tok/s | compile s |\n|---|---|---|---|---|")
        for r in out["meshes"]:
            lines.append(f"| {_mesh_text(r['mesh'])} | {gib(r['total']) if r['total'] else 'over HBM'} | "
                         f"{r['fits']} | {r['tokens_per_s']} | {r['compile_seconds']} |")
        lines.append("")
    if not out.get("compiled"):
        return "\n".join(lines + [f"does not fit: {out['reason']}"])
    pc, pr = out["per_chip_bytes"], out["predicted"]
    lines += [
        f"topology {out['topology']} ({out['device_kind']}, {out['chips']} chips), mesh {_mesh_text(out['mesh'])}",
        f"per chip: arguments {gib(pc['arguments'])} GiB + temp {gib(pc['temp'])} GiB + code {gib(pc['code'])} GiB"
        f" = {gib(pc['total'])} GiB of {gib(out['hbm_bytes'])} GiB -> "
        + ("fits" if out["fits"] else f"DOES NOT FIT ({out.get('reason', '')})")
        + (f"; largest batch {out['largest_batch']}" if out.get("largest_batch") else ""),
        f"Mosaic calls {out['mosaic_calls']} (interpreted {out['interpreted']}); collectives "
        + ", ".join(f"{k} {v['count']} ({v['bytes'] / 2**20:.1f} MiB)" for k, v in out["collectives"].items()
                    if v["count"]),
        f"XLA cost (loop bodies once): {out['flops'] / 1e9:.1f} GFLOP, {out['bytes_accessed'] / 1e9:.2f} GB accessed;"
        f" compile {out['compile_seconds']} s",
        f"floor: {gib(pr['bytes_per_forward'])} GiB read per forward per chip at {pr['hbm_bytes_per_s'] / 1e9:.0f} GB/s, "
        f"{pr['flops_per_forward'] / 1e12:.2f} TFLOP at {pr['bf16_flops_per_s'] / 1e12:.0f} TFLOP/s ({pr['bound']} bound)"
        f" -> {pr['forwards_per_s']} forwards/s, {pr['tokens_per_s']} tokens/s at TPF {pr['tpf']} ({pr['source']})",
        "audits: " + ", ".join(f"{k}={v}" for k, v in out["audits"].items()),
    ]
    return "\n".join(lines)

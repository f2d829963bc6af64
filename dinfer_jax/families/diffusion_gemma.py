"""DiffusionGemma, text part (uniform-noise block diffusion on the Gemma-4 text stack; facts:
docs/diffusion_gemma.md): `config_from_hf` / `params_from_hf` / `load(folder)` read an HF checkpoint
(no vision tower); `generate` / `generate_with_draws` run the whole generation in one jitted program
(`draws` replay the reference's random numbers); `logits` gives the decoder's (B, C, V) logits.
What is not built yet: docs/internals/families.md (DiffusionGemma)."""
from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
from typing import Any, Mapping, Optional

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from dinfer_jax import checkpoint as ckpt
from dinfer_jax import sharding as shd
from dinfer_jax.decoding import entropy_bound as eb
from dinfer_jax.families import DIFFUSION_GEMMA_ARCHITECTURES
from dinfer_jax.models import flatten, unflatten
from dinfer_jax.models.gemma4 import FULL, SLIDING, EncoderCache, Gemma4Config, Gemma4Diffusion, boxed_params
from dinfer_jax.token_ids import check_token_ids

log = logging.getLogger(__name__)

ARCHITECTURES = DIFFUSION_GEMMA_ARCHITECTURES
DEFAULT_CANVAS_LENGTH = 256


# The released google/diffusiongemma-26B-A4B-it text config (third-party sources, docs/diffusion_gemma.md §1:
# the transformers package does not state it): 25.25 B parameters, 3.84 B active per token.
PRESETS = {
    "diffusion-gemma-26b-a4b": {
        "architectures": list(ARCHITECTURES), "canvas_length": 256,
        "text_config": {"hidden_size": 2816, "intermediate_size": 2112, "moe_intermediate_size": 704,
                        "num_experts": 128, "top_k_experts": 8, "num_hidden_layers": 30, "num_attention_heads": 16,
                        "num_key_value_heads": 8, "head_dim": 256, "global_head_dim": 512,
                        "num_global_key_value_heads": 2, "sliding_window": 1024, "vocab_size": 262144,
                        "max_position_embeddings": 262144, "use_bidirectional_attention": "vision",
                        "final_logit_softcapping": 30.0}},
}
# A tiny model of the same layout (tests, the compile matrix): 2 layers (sliding, full), 8 experts.
PRESETS["diffusion-gemma-tiny"] = {
    **PRESETS["diffusion-gemma-26b-a4b"], "canvas_length": 8,
    "text_config": {**PRESETS["diffusion-gemma-26b-a4b"]["text_config"],
                    "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32, "num_experts": 8,
                    "top_k_experts": 2, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                    "head_dim": 16, "global_head_dim": 32, "num_global_key_value_heads": 1, "sliding_window": 16,
                    "vocab_size": 512, "max_position_embeddings": 1024}}


def preset(name: str) -> tuple[Gemma4Config, int]:
    """(Gemma4Config, canvas_length) of a named preset (PRESETS)."""
    if name not in PRESETS:
        raise ValueError(f"unknown DiffusionGemma preset {name!r}; known: {', '.join(PRESETS)}")
    return config_from_hf(PRESETS[name])


# ---- config and weights

def config_from_hf(hf: Mapping[str, Any]) -> tuple[Gemma4Config, int]:
    """A DiffusionGemma config.json (or its text_config alone) -> (Gemma4Config, canvas_length)."""
    tc = dict(hf.get("text_config", hf))
    canvas = int(hf.get("canvas_length", DEFAULT_CANVAS_LENGTH))
    missing = [k for k in ("num_experts", "top_k_experts", "moe_intermediate_size") if tc.get(k) is None]
    if missing:
        raise ValueError(f"DiffusionGemma config: {', '.join(missing)} must be set (the router needs them)")
    n = int(tc.get("num_hidden_layers", 30))
    types = tc.get("layer_types") or [FULL if (i + 1) % 6 == 0 else SLIDING for i in range(n)]
    types = list(types[:n])
    types[-1] = FULL  # the reference forces the last layer global
    per = {int(k): v for k, v in (tc.get("per_layer_config") or {}).items()} if isinstance(
        tc.get("per_layer_config"), dict) else {}
    head_dim = int(tc.get("head_dim", 256))
    kv = int(tc.get("num_key_value_heads", 4))
    full = [i for i, t in enumerate(types) if t == FULL]
    full_over = per.get(full[0], {}) if full else {}
    full_hd = int(full_over.get("head_dim", tc.get("global_head_dim", 512)))
    full_kv = int(full_over.get("num_key_value_heads", tc.get("num_global_key_value_heads") or kv))
    for i in full:
        o = per.get(i, {})
        if int(o.get("head_dim", full_hd)) != full_hd or int(o.get("num_key_value_heads", full_kv)) != full_kv:
            raise ValueError(f"DiffusionGemma config: full layer {i} has shapes unlike layer {full[0]}'s")
    window = int(tc.get("sliding_window", 512))
    if tc.get("use_bidirectional_attention") == "all":  # serialised as (W - 1) * 2
        window = window // 2 + 1
    rope = tc.get("rope_parameters") or {}
    sl, fu = rope.get(SLIDING, {}), rope.get(FULL, {})
    if fu.get("rope_type", "proportional") != "proportional" or sl.get("rope_type", "default") != "default":
        raise ValueError(f"DiffusionGemma config: unsupported rope_parameters {rope}")
    cfg = Gemma4Config(
        vocab_size=int(tc.get("vocab_size", 262144)), hidden_size=int(tc.get("hidden_size", 2304)),
        intermediate_size=int(tc.get("intermediate_size", 9216)), num_heads=int(tc.get("num_attention_heads", 8)),
        layer_types=tuple(types), sliding_kv_heads=kv, sliding_head_dim=head_dim, full_kv_heads=full_kv,
        full_head_dim=full_hd, num_experts=int(tc["num_experts"]), top_k_experts=int(tc["top_k_experts"]),
        moe_intermediate_size=int(tc["moe_intermediate_size"]), sliding_window=window,
        sliding_rope_theta=float(sl.get("rope_theta", 1e4)), full_rope_theta=float(fu.get("rope_theta", 1e6)),
        full_partial_rotary_factor=float(fu.get("partial_rotary_factor", 0.25)),
        rms_norm_eps=float(tc.get("rms_norm_eps", 1e-6)),
        final_logit_softcapping=tc.get("final_logit_softcapping", 30.0))
    return cfg, canvas


_NORMS = {"input_layernorm": "input_norm", "post_attention_layernorm": "post_attn_norm",
          "pre_feedforward_layernorm": "pre_ffn_norm", "post_feedforward_layernorm": "post_ffn_norm",
          "pre_feedforward_layernorm_2": "pre_ffn_norm_2", "post_feedforward_layernorm_1": "post_ffn_norm_1",
          "post_feedforward_layernorm_2": "post_ffn_norm_2"}


GLOBALS = "globals"  # the group of the non-layer params: embed, final_norm, self_conditioning


def groups(cfg: Gemma4Config) -> list[str]:
    """The param tree's conversion groups in order: GLOBALS, then layer_0 .. layer_{n-1}."""
    return [GLOBALS] + [f"layer_{i}" for i in range(len(cfg.layer_types))]


def group_keys(group: str) -> tuple[str, ...]:
    """The top-level keys of the param tree a conversion group holds."""
    return ("embed", "final_norm", "self_conditioning") if group == GLOBALS else (group,)


def group_from_hf(get, cfg: Gemma4Config, group: str, dtype=jnp.float32) -> dict:
    """One group of our param tree (models/gemma4.py), {top-level key: subtree}, from the checkpoint's
    text weights. `get(name)` returns the numpy array saved under an HF name (model.decoder.* holds
    the shared weights; the encoder pass's layer scalars are model.encoder.language_model.layers.L.layer_scalar)."""
    D, N = cfg.hidden_size, cfg.num_heads

    def a(name):  # one tensor at a time, straight to the params dtype (peak: params + one tensor)
        return jnp.asarray(np.asarray(get(name)), dtype)

    def lin(name):  # HF Linear [out, in] -> (in, out)
        return a(name).T

    if group == GLOBALS:
        sc = "model.decoder.self_conditioning."
        return {"embed": {"embedding": a("model.decoder.embed_tokens.weight")},
                "final_norm": a("model.decoder.norm.weight"),
                "self_conditioning": {"pre_norm": a(sc + "pre_norm.weight"),
                                      "mlp": {k: lin(f"{sc}{k}.weight") for k in ("gate_proj", "up_proj", "down_proj")}}}
    i = int(group[len("layer_"):])
    kind, F = cfg.layer_types[i], cfg.moe_intermediate_size
    p = f"model.decoder.layers.{i}."
    K, H = cfg.kv_shape(kind)
    attn = {"q_proj": lin(p + "self_attn.q_proj.weight").reshape(D, N, H),
            "k_proj": lin(p + "self_attn.k_proj.weight").reshape(D, K, H),
            "o_proj": lin(p + "self_attn.o_proj.weight").reshape(N, H, D),
            "q_norm": a(p + "self_attn.q_norm.weight"), "k_norm": a(p + "self_attn.k_norm.weight")}
    if kind == SLIDING:
        attn["v_proj"] = lin(p + "self_attn.v_proj.weight").reshape(D, K, H)
    gate_up = a(p + "experts.gate_up_proj")  # [E, 2F, D], gate rows first
    return {group: {
        "attn": attn, **{ours: a(p + hf + ".weight") for hf, ours in _NORMS.items()},
        "mlp": {k: lin(f"{p}mlp.{k}.weight") for k in ("gate_proj", "up_proj", "down_proj")},
        "router": {"proj": lin(p + "router.proj.weight"), "scale": a(p + "router.scale"),
                   "per_expert_scale": a(p + "router.per_expert_scale")},
        "experts": {"gate_proj": gate_up[:, :F].transpose(0, 2, 1), "up_proj": gate_up[:, F:].transpose(0, 2, 1),
                    "down_proj": a(p + "experts.down_proj").transpose(0, 2, 1)},
        "decoder_scalar": a(p + "layer_scalar").reshape(1),
        "encoder_scalar": a(f"model.encoder.language_model.layers.{i}.layer_scalar").reshape(1)}}


def group_to_hf(tree: dict, cfg: Gemma4Config, group: str) -> dict:
    """The inverse of group_from_hf: {HF name: array} of one group (`tree`: {top-level key: subtree},
    jax / numpy arrays or ShapeDtypeStructs under jax.eval_shape). Shared weights take the decoder's
    names (as save_pretrained writes them); the vision tower is not ours to write."""
    def lin(w):  # (in, out) -> HF Linear [out, in]
        return jnp.asarray(w).T

    if group == GLOBALS:
        sc, mlp = "model.decoder.self_conditioning.", tree["self_conditioning"]["mlp"]
        return {"model.decoder.embed_tokens.weight": jnp.asarray(tree["embed"]["embedding"]),
                "model.decoder.norm.weight": jnp.asarray(tree["final_norm"]),
                sc + "pre_norm.weight": jnp.asarray(tree["self_conditioning"]["pre_norm"]),
                **{f"{sc}{k}.weight": lin(mlp[k]) for k in ("gate_proj", "up_proj", "down_proj")}}
    i, t = int(group[len("layer_"):]), tree[group]
    p, at, D = f"model.decoder.layers.{i}.", t["attn"], cfg.hidden_size
    out = {p + "self_attn.q_proj.weight": lin(jnp.reshape(at["q_proj"], (D, -1))),
           p + "self_attn.k_proj.weight": lin(jnp.reshape(at["k_proj"], (D, -1))),
           p + "self_attn.o_proj.weight": lin(jnp.reshape(at["o_proj"], (-1, D))),
           p + "self_attn.q_norm.weight": jnp.asarray(at["q_norm"]), p + "self_attn.k_norm.weight": jnp.asarray(at["k_norm"])}
    if "v_proj" in at:
        out[p + "self_attn.v_proj.weight"] = lin(jnp.reshape(at["v_proj"], (D, -1)))
    out.update({p + hf + ".weight": jnp.asarray(t[ours]) for hf, ours in _NORMS.items()})
    out.update({f"{p}mlp.{k}.weight": lin(t["mlp"][k]) for k in ("gate_proj", "up_proj", "down_proj")})
    ex = t["experts"]
    out.update({p + "router.proj.weight": lin(t["router"]["proj"]), p + "router.scale": jnp.asarray(t["router"]["scale"]),
                p + "router.per_expert_scale": jnp.asarray(t["router"]["per_expert_scale"]),
                p + "experts.gate_up_proj": jnp.concatenate([jnp.swapaxes(ex["gate_proj"], 1, 2),
                                                             jnp.swapaxes(ex["up_proj"], 1, 2)], axis=1),
                p + "experts.down_proj": jnp.swapaxes(ex["down_proj"], 1, 2),
                p + "layer_scalar": jnp.asarray(t["decoder_scalar"]),
                f"model.encoder.language_model.layers.{i}.layer_scalar": jnp.asarray(t["encoder_scalar"])})
    return out


def params_from_hf(get, cfg: Gemma4Config, dtype=jnp.float32) -> dict:
    """Our param tree (models/gemma4.py) from the checkpoint's text weights (`get`: group_from_hf's)."""
    out: dict = {}
    for g in groups(cfg):
        out.update(group_from_hf(get, cfg, g, dtype))
    return out


def is_folder(path) -> bool:
    """Whether `path` is an HF folder of a DiffusionGemma checkpoint (config.json architectures)."""
    cfg = os.path.join(os.fspath(path), "config.json")
    if not os.path.isfile(cfg):
        return False
    try:
        with open(cfg) as f:
            hf = json.load(f)
    except (OSError, ValueError):
        return False
    return isinstance(hf, dict) and bool(set(hf.get("architectures") or ()) & set(ARCHITECTURES))


def _shared_aliases(name: str) -> list[str]:
    """Where a shared text weight may be stored: the decoder's name or the encoder's (save_pretrained
    keeps one copy of tied tensors; which one depends on the writer)."""
    dec, enc = "model.decoder.", "model.encoder.language_model."
    if name.startswith(dec) and not name.endswith("layer_scalar"):
        return [name, enc + name[len(dec):]]
    return [name]


def tensor_getter(folder: str, src):
    """group_from_hf's `get` over an open converters.sources source of `folder`: a shared weight
    under either backbone's name; ValueError naming a missing weight."""
    names = set(src.specs)

    def get(name):
        for cand in _shared_aliases(name):
            if cand in names:
                return src.read(cand)
        if name.startswith("model.encoder.") and name.endswith("layer_scalar"):
            dec = "model.decoder." + name[len("model.encoder.language_model."):]
            if dec in names:  # one scalar per layer (a checkpoint written for a single backbone)
                log.warning("%s: no encoder layer scalar %s; using the decoder's", folder, name)
                return src.read(dec)
        raise ValueError(f"{folder}: weight {name!r} is missing from the checkpoint")
    return get


def check_mesh(cfg: Gemma4Config, mesh) -> None:
    """ValueError naming the mesh when the experts cannot split over its "expert" axis or their width
    over its "model" axis."""
    ep, tp = mesh.shape["expert"], mesh.shape["model"]
    if cfg.num_experts % ep or cfg.moe_intermediate_size % tp:
        raise ValueError(f"mesh {shd.mesh_summary(mesh)}: the {cfg.num_experts} experts must split over expert={ep} "
                         f"and their width {cfg.moe_intermediate_size} over model={tp}")


def abstract_params(cfg: Gemma4Config, dtype=jnp.float32, mesh=None):
    """The param tree as ShapeDtypeStructs (no weights), each with its NamedSharding on `mesh` read
    from the layers' logical axes when a mesh is given (non-strict: a dim that does not split stays
    whole)."""
    boxed = jax.eval_shape(lambda: boxed_params(cfg, dtype=dtype))
    specs, shapes = nn.get_partition_spec(boxed), nn.meta.unbox(boxed)
    if mesh is None:
        return shapes

    def place(path, sds, spec):
        what = "/".join(str(getattr(k, "key", k)) for k in path)
        sharding = NamedSharding(mesh, shd.logical_spec(tuple(spec), tuple(sds.shape), mesh, what=what))
        return jax.ShapeDtypeStruct(sds.shape, sds.dtype, sharding=sharding)
    return jax.tree_util.tree_map_with_path(place, shapes, specs, is_leaf=lambda x: isinstance(x, jax.ShapeDtypeStruct))


def param_shardings(cfg: Gemma4Config, mesh, dtype=jnp.float32):
    """The param tree's NamedShardings on `mesh` (those of `abstract_params`)."""
    return jax.tree_util.tree_map(lambda s: s.sharding, abstract_params(cfg, dtype, mesh))


def load(folder, dtype=None, mesh=None) -> "DiffusionGemma":
    """A DiffusionGemma HF folder (config.json + *.safetensors / .bin), or its dinfer-jax checkpoint
    (`dinfer-jax convert`) -> DiffusionGemma, its text part read tensor by tensor (the vision tower is not loaded: text prompts only). mesh: a
    sharding.make_mesh mesh the params are placed on (experts over "expert"; None: one device)."""
    from converters.sources import open_source
    folder = os.fspath(folder)
    with open(os.path.join(folder, "config.json")) as f:
        hf = json.load(f)
    cfg, canvas = config_from_hf(hf)
    if mesh is not None:
        check_mesh(cfg, mesh)
    dtype = (jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16) if dtype is None else dtype
    if ckpt.is_checkpoint(folder):  # `dinfer-jax convert`'s output: each param restored into its sharding
        man = ckpt.read_manifest(folder)
        expected = flatten(abstract_params(cfg, dtype, mesh))  # one eval_shape: paths and shardings
        shardings = {} if mesh is None else {p: sds.sharding for p, sds in expected.items()}
        if set(man["params"]) != set(expected):
            raise ValueError(f"{folder}: the checkpoint's params do not match its config.json (missing "
                             f"{sorted(set(expected) - set(man['params']))[:3]}, unexpected "
                             f"{sorted(set(man['params']) - set(expected))[:3]})")
        params = unflatten({p: ckpt.read_param(folder, p, shardings.get(p), dtype, man) for p in expected})
        params = jax.tree_util.tree_map(jnp.asarray, params)
        return DiffusionGemma(cfg, params, canvas, mesh)
    src = open_source(folder)
    try:
        params = params_from_hf(tensor_getter(folder, src), cfg, dtype)
    finally:
        src.close()
    if any(n.startswith("model.encoder.vision_tower.") for n in src.specs):
        log.info("%s: the vision tower is not loaded (text prompts only)", folder)
    if mesh is not None:
        params = jax.device_put(params, param_shardings(cfg, mesh, dtype))
    return DiffusionGemma(cfg, params, canvas, mesh)


# ---- the model and its entry points

@dataclasses.dataclass(frozen=True)
class DiffusionGemma:
    """A loaded model: config, canvas length, params (models/gemma4.py's tree), and the mesh they
    are placed on (None: one device)."""
    cfg: Gemma4Config
    params: Any
    canvas_length: int = DEFAULT_CANVAS_LENGTH
    mesh: Any = None

    @property
    def module(self) -> Gemma4Diffusion:
        return Gemma4Diffusion(self.cfg, jax.tree_util.tree_leaves(self.params)[0].dtype, self.mesh)

    def logits(self, prompt_ids, *, canvas=None, self_conditioning=None) -> np.ndarray:
        """The decoder's fp32 (B, C, V) logits over `canvas` (B, C) after the encoder encoded
        `prompt_ids` (B, L); `self_conditioning`: the previous step's (B, C, V) logits or None."""
        if canvas is None:
            raise ValueError("DiffusionGemma's logits are the decoder's over a canvas: pass canvas=(B, C) token ids "
                             "(the encoder pass computes no logits)")
        return logits(self, prompt_ids, canvas, self_conditioning)


def _check_ids(cfg: Gemma4Config, ids, what: str) -> np.ndarray:
    """(L,) or (B, L) ids -> (B, L) int32 (ValueError naming a bad id or shape)."""
    arr = check_token_ids(ids, cfg.vocab_size, what=what)
    return arr[None] if arr.ndim == 1 else arr


@functools.partial(jax.jit, static_argnums=(0,))
def _logits(module, params, prompt_BL, canvas_BC, sc_BCV, sc_on):
    B, L = prompt_BL.shape
    cache = EncoderCache.empty(module.cfg, B, L, module.dtype)
    cache = module.apply({"params": params}, prompt_BL, cache, method=Gemma4Diffusion.encode)
    return module.apply({"params": params}, canvas_BC, cache, sc_BCV, jnp.broadcast_to(sc_on, (B,)),
                        method=Gemma4Diffusion.decode)


def logits(model: DiffusionGemma, prompt_ids, canvas, self_conditioning=None) -> np.ndarray:
    """The decoder's fp32 (B, C, V) logits for `canvas` after the encoder encoded `prompt_ids`;
    `self_conditioning`: the previous step's (B, C, V) (processed) logits, or None (first step)."""
    prompt = _check_ids(model.cfg, prompt_ids, "prompt_ids")
    canvas = _check_ids(model.cfg, canvas, "canvas")
    if canvas.shape[0] != prompt.shape[0]:
        raise ValueError(f"canvas has {canvas.shape[0]} rows for {prompt.shape[0]} prompts")
    sc = self_conditioning
    if sc is not None and np.shape(sc) != canvas.shape + (model.cfg.vocab_size,):
        raise ValueError(f"self_conditioning: expected shape {canvas.shape + (model.cfg.vocab_size,)}, got {np.shape(sc)}")
    sc_arr = jnp.zeros(canvas.shape + (model.cfg.vocab_size,)) if sc is None else jnp.asarray(sc, jnp.float32)
    return np.asarray(_logits(model.module, model.params, jnp.asarray(prompt), jnp.asarray(canvas), sc_arr,
                              jnp.bool_(sc is not None)))


@dataclasses.dataclass(frozen=True)
class DiffusionGemmaSettings:
    """The reference's generation-config fields and defaults (docs/diffusion_gemma.md §5)."""
    max_new_tokens: int = 256
    max_denoising_steps: int = 48
    entropy_bound: float = 0.1
    t_min: float = 0.4
    t_max: float = 0.8
    stability_threshold: int = 1
    confidence_threshold: float = 0.005
    eos_token_id: tuple[int, ...] = ()
    pad_token_id: Optional[int] = None

    def __post_init__(self):
        eos = self.eos_token_id
        object.__setattr__(self, "eos_token_id", tuple(int(e) for e in ((eos,) if isinstance(eos, int) else (eos or ()))))
        if not (isinstance(self.max_new_tokens, int) and self.max_new_tokens > 0):
            raise ValueError(f"max_new_tokens={self.max_new_tokens!r}: must be a positive integer")
        if not (isinstance(self.max_denoising_steps, int) and self.max_denoising_steps > 0):
            raise ValueError(f"max_denoising_steps={self.max_denoising_steps!r}: must be a positive integer")
        if not self.t_max > self.t_min >= 0:
            raise ValueError(f"t_min={self.t_min}, t_max={self.t_max}: need t_max > t_min >= 0")
        if not self.entropy_bound > 0:
            raise ValueError(f"entropy_bound={self.entropy_bound}: must be > 0")
        if not self.confidence_threshold > 0:
            raise ValueError(f"confidence_threshold={self.confidence_threshold}: must be > 0")
        if not (isinstance(self.stability_threshold, int) and self.stability_threshold >= 0):
            raise ValueError(f"stability_threshold={self.stability_threshold!r}: must be an integer >= 0")


@flax.struct.dataclass
class _Knobs:
    """The settings that are traced values (one program serves them all)."""
    max_denoising_steps: jax.Array
    entropy_bound: jax.Array
    t_min: jax.Array
    t_span: jax.Array  # t_max - t_min, subtracted in double as the reference does, then fp32
    confidence_threshold: jax.Array
    eos_ids: jax.Array  # (8k,) the EOS ids, -1 padded
    pad_id: jax.Array  # () int32
    has_pad: jax.Array  # () whether pad_token_id is set (EOS then pads the canvas after it)
    replay: jax.Array  # () draws fed in (generate_with_draws) instead of drawn

    @classmethod
    def of(cls, s: DiffusionGemmaSettings, replay: bool) -> "_Knobs":
        n = -(-max(1, len(s.eos_token_id)) // 8) * 8
        eos = np.full((n,), -1, np.int32)
        eos[:len(s.eos_token_id)] = s.eos_token_id
        return cls(jnp.int32(s.max_denoising_steps), *(jnp.float32(v) for v in (
            s.entropy_bound, s.t_min, s.t_max - s.t_min, s.confidence_threshold)), jnp.asarray(eos),
            jnp.int32(s.pad_token_id or 0), jnp.bool_(s.pad_token_id is not None), jnp.bool_(replay))


@flax.struct.dataclass
class _Draws:
    """Random numbers fed in (replay) or drawn: init (n_canvases, B, C), sample / renoise (n_steps, B, C)."""
    init: jax.Array
    sample: jax.Array
    renoise: jax.Array


@flax.struct.dataclass
class _CanvasState:
    """One canvas's denoising loop state (B rows, C positions, H = stability_threshold)."""
    step: jax.Array  # () remaining steps: N .. 1, then 0
    canvas: jax.Array  # (B, C) current (noisy) canvas
    argmax: jax.Array  # (B, C)
    sc: jax.Array  # (B, C, V) previous processed logits (emb dtype)
    sc_on: jax.Array  # () whether sc is set (False on the first step)
    done: jax.Array  # (B,) stopped rows (frozen)
    history: jax.Array  # (H, B, C) previous argmax canvases
    draw: jax.Array  # () index of the next sample / renoise draw
    key: jax.Array


@flax.struct.dataclass
class _GenState:
    cache: EncoderCache
    out: jax.Array  # (B, n_canvases * C) committed canvases
    canvases: jax.Array  # () canvases committed
    finished: jax.Array  # (B,) rows that met EOS
    draw: jax.Array
    key: jax.Array


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3))
def _generate(module: Gemma4Diffusion, canvas_length: int, n_canvases: int, stability_threshold: int,
              params, prompt_BL, prompt_valid_BL, draws: _Draws, key, knobs: _Knobs):
    """-> (out (B, n_canvases * C), canvases produced, draws consumed). Shapes and the stability
    history are static; every other setting is a traced _Knobs value (one program serves them)."""
    cfg, C = module.cfg, canvas_length
    B, L = prompt_BL.shape
    N = knobs.max_denoising_steps
    apply = functools.partial(module.apply, {"params": params})
    cache = EncoderCache.empty(cfg, B, L + n_canvases * C, module.dtype)
    cache = apply(prompt_BL, cache, prompt_valid_BL, method=Gemma4Diffusion.encode)
    V = cfg.vocab_size

    def uniform(k, i, table):
        return jnp.where(knobs.replay, table[jnp.minimum(i, len(table) - 1)], jax.random.randint(k, (B, C), 0, V, jnp.int32))

    def denoise_step(cs: _CanvasState, cache):
        k1, k2, key = jax.random.split(cs.key, 3)
        raw = apply(cs.canvas, cache, cs.sc, jnp.broadcast_to(cs.sc_on, (B,)), method=Gemma4Diffusion.decode)
        processed = raw / eb.temperature(cs.step, N, knobs.t_min, knobs.t_span)
        sample = jnp.where(knobs.replay, draws.sample[jnp.minimum(cs.draw, len(draws.sample) - 1)],
                           jax.random.categorical(k1, processed, axis=-1).astype(jnp.int32))
        argmax = jnp.argmax(processed, axis=-1).astype(jnp.int32)
        h = eb.entropy(processed)
        keep = eb.accept_mask(h, knobs.entropy_bound)
        nxt = jnp.where(keep, sample, uniform(k2, cs.draw, draws.renoise))
        frozen = cs.done
        argmax = jnp.where(frozen[:, None], cs.argmax, argmax)
        nxt = jnp.where(frozen[:, None], cs.canvas, nxt)
        processed = jnp.where(frozen[:, None, None] & cs.sc_on, cs.sc.astype(processed.dtype), processed)
        stop, history = eb.stable_and_confident(cs.history, argmax, eb.entropy(processed),
                                                knobs.confidence_threshold)
        return _CanvasState(step=cs.step - 1, canvas=nxt, argmax=argmax, sc=processed.astype(cs.sc.dtype),
                            sc_on=jnp.bool_(True), done=cs.done | stop, history=history, draw=cs.draw + 1, key=key)

    def canvas_body(g: _GenState):
        ci = g.canvases
        kc, key = jax.random.split(g.key)
        committed = jax.lax.dynamic_slice_in_dim(g.out, jnp.maximum(ci - 1, 0) * C, C, axis=1)
        cache = jax.lax.cond(ci > 0, lambda c: apply(committed, c, method=Gemma4Diffusion.encode), lambda c: c,
                             g.cache)
        init = uniform(kc, ci, draws.init)
        cs = _CanvasState(step=N, canvas=init, argmax=init,
                          sc=jnp.zeros((B, C, V), module.dtype), sc_on=jnp.bool_(False),
                          done=jnp.zeros((B,), bool), history=jnp.full((stability_threshold, B, C), -1, jnp.int32),
                          draw=g.draw, key=key)
        cs = jax.lax.while_loop(lambda cs: (cs.step > 0) & ~jnp.all(cs.done),
                                lambda cs: denoise_step(cs, cache), cs)
        padded, has_eos = eb.pad_after_eos(cs.argmax, knobs.eos_ids, knobs.pad_id, g.finished)
        finished = g.finished | has_eos
        new = jnp.where(knobs.has_pad & jnp.any(finished), padded, cs.argmax)
        out = jax.lax.dynamic_update_slice_in_dim(g.out, new, ci * C, axis=1)
        return _GenState(cache=cache, out=out, canvases=ci + 1, finished=finished, draw=cs.draw, key=cs.key)

    g = _GenState(cache=cache, out=jnp.full((B, n_canvases * C), knobs.pad_id, jnp.int32),
                  canvases=jnp.int32(0), finished=jnp.zeros((B,), bool), draw=jnp.int32(0), key=key)
    g = jax.lax.while_loop(lambda g: (g.canvases < n_canvases) & ~jnp.all(g.finished), canvas_body, g)
    return g.out, g.canvases, g.draw


def _bucket(n: int, lo: int) -> int:
    return max(lo, 1 << max(0, n - 1).bit_length())


def _run(model: DiffusionGemma, prompt_ids, settings: DiffusionGemmaSettings, draws: Optional[_Draws], key,
         prompt_mask=None) -> np.ndarray:
    prompt = _check_ids(model.cfg, prompt_ids, "prompt_ids")
    valid = np.ones(prompt.shape, bool) if prompt_mask is None else np.asarray(prompt_mask, bool)
    if valid.shape != prompt.shape:
        raise ValueError(f"prompt_mask: shape {valid.shape} != prompt shape {prompt.shape}")
    replay = draws is not None
    C = model.canvas_length
    # draws padded to bucketed lengths (dummies when not replaying): one program for many settings
    init = np.zeros((0, *prompt.shape[:1], C), np.int32) if draws is None else np.asarray(draws.init)
    steps = np.zeros((0, *prompt.shape[:1], C), np.int32) if draws is None else np.asarray(draws.sample)
    renoise = steps if draws is None else np.asarray(draws.renoise)
    draws = _Draws(*(jnp.asarray(np.concatenate([a, np.zeros((_bucket(len(a), lo) - len(a), *a.shape[1:]), np.int32)]))
                     for a, lo in ((init, 4), (steps, 64), (renoise, 64))))
    out, n, _ = _generate(model.module, C, -(-settings.max_new_tokens // C), settings.stability_threshold,
                          model.params, jnp.asarray(prompt), jnp.asarray(valid), draws, key, _Knobs.of(settings, replay))
    return np.asarray(out)[:, :int(n) * model.canvas_length]


def generate(model: DiffusionGemma, prompt_ids, settings: DiffusionGemmaSettings = DiffusionGemmaSettings(),
             seed: int = 0, prompt_mask=None) -> np.ndarray:
    """Generated ids after the prompt, (B, n * C) for the n canvases produced (as the reference's
    `sequences[:, L:]`), with our RNG (same distributions as the reference, other numbers)."""
    return _run(model, prompt_ids, settings, None, jax.random.PRNGKey(seed), prompt_mask)


def generate_with_draws(model: DiffusionGemma, prompt_ids, draws: Mapping[str, Any], prompt_mask=None,
                        **settings) -> np.ndarray:
    """`generate` with the reference's random numbers fed in: draws = {"init": (n_canvases, B, C),
    "sample": (n_steps, B, C) the multinomial samples, "renoise": (n_steps, B, C) the uniform
    draws}, consumed in order; settings named as the reference's generation config."""
    missing = {"init", "sample", "renoise"} - set(draws)
    if missing:
        raise ValueError(f"draws: missing {sorted(missing)}")
    d = _Draws(*(jnp.asarray(np.asarray(draws[k]), jnp.int32) for k in ("init", "sample", "renoise")))
    B = _check_ids(model.cfg, prompt_ids, "prompt_ids").shape[0]
    for k, a in zip(("init", "sample", "renoise"), (d.init, d.sample, d.renoise)):
        if a.ndim != 3 or a.shape[1:] != (B, model.canvas_length):
            raise ValueError(f"draws[{k!r}]: expected (n, {B}, {model.canvas_length}), got {a.shape}")
    return _run(model, prompt_ids, DiffusionGemmaSettings(**settings), d, jax.random.PRNGKey(0), prompt_mask)


def settings_from_generation_config(gen: Mapping[str, Any]) -> DiffusionGemmaSettings:
    """A generation_config.json dict -> settings (unset fields keep the reference's defaults)."""
    fields = {f.name for f in dataclasses.fields(DiffusionGemmaSettings)}
    sampler = gen.get("sampler_config") or {}
    kw = {k: gen[k] for k in fields if gen.get(k) is not None}
    if isinstance(sampler, dict) and sampler.get("entropy_bound") is not None:
        kw.setdefault("entropy_bound", sampler["entropy_bound"])
    return DiffusionGemmaSettings(**kw)

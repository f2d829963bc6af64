"""dinfer-jax vs the peers' OWN engines (Fast-dLLM, dInfer) on the same Hugging Face checkpoint.

  python bench/compare_peers.py --fast-dllm /tmp/peers/fast-dllm --dinfer /tmp/peers/dinfer \
      --out bench/compare_peers.json

The peers are NOT vendored: pass paths to checkouts of github:NVlabs/Fast-dLLM and
github:inclusionAI/dInfer. Their model code and decode loops are imported from those paths:
- Fast-dLLM: `llada/model/modeling_llada.py` (LLaDAModelLM, loaded with `from_pretrained` from our
  export) and `llada/generate.py::generate_with_dual_cache` (threshold 0.9, remasking
  low_confidence, temperature 0, steps = gen_length). Its loop has no EOS early stop, so our side
  runs with `early_stop=False` against it.
- dInfer: `python/dinfer/model/modeling_llada.py` (LLaDAModelLM) driven by
  `python/dinfer/decoding/generate_uniform.py::BlockWiseDiffusionLLM` with
  `ThresholdParallelDecoder(temperature=0, threshold=0.9)` (fp32 softmax, its default) and
  `KVCacheFactory('dual')`, `BlockIteratorFactory()`, `early_stop=True` (its benchmark.py's
  setup; our side also early_stop=True).
What is stubbed or bypassed (printed at start and stored in the json, key "peer_shims"):
- dInfer's package `__init__` files (dinfer/__init__.py imports decoding/serving.py, which imports
  vllm; dinfer/model/__init__.py imports the vLLM fused-MoE model) are bypassed by registering the
  three packages as empty modules with their real __path__; the submodules are then imported as is.
- `vllm.distributed.get_tensor_model_parallel_rank / _world_size` (imported at the top of dInfer's
  modeling_llada.py; called only at construction, in LLaDABlock.__init__, and by the unused
  tensor_parallel()) -> a stub module returning 0 / 1 (one process, no tensor parallelism).
- dInfer's LLaDAModelLM.__init__ hardcodes `init_device = "cuda"` (modeling_llada.py, in
  LLaDAModelLM.__init__): we build its LLaDAModel with its own config helper and init_device="cpu"
  and pass it in through the constructor's `model=` argument, then load the exported safetensors
  with load_state_dict(strict=True). No call on the measured path is replaced.
Fast-dLLM needs nothing stubbed on CPU (flash-attn is only imported when config.flash_attention).

Checkpoints (LLaDA dense, random weights: normal(0, 0.02), norms 1, LM head x`--head-scale` so
threshold decoding commits several tokens per forward, and the LM-head row of the mask token
zeroed so no side ever predicts [MASK] -- Fast-dLLM does not exclude it, dInfer and we do):
  medium  d_model 1024, 8 layers, 16 heads, ffn 2816, vocab 32000
  tiny    the demo model's widths (d_model 256, 4 layers, 8 heads, vocab 100), dense: the real
          demo model (dinfer_jax/demo_model) is LLaDA-MoE, which neither peer can run here
          (Fast-dLLM's llada/ has no MoE class; dInfer's LLaDA-MoE class needs vLLM's fused-MoE
          kernels, see RESULTS.md).
Both sides read the same files: ours loads the dinfer-jax checkpoint, the peers load its HF
export (converters.export). fp32, batch 1, prompts one at a time; `--threads` CPUs (process pinned)
for XLA and torch. Every timing round runs all prompts on every side, the order rotating per
round; medians + min/max. Tokens are compared on every round: generated tokens with EOS removed
(dInfer's generate() returns the sequence without EOS); a divergence is reported with the first
differing position and how near a tie the decision was there (`margin_at`: top-1 minus top-2 logit
and confidence minus tau from our model's forward), not hidden.

On a GPU (`--device cuda`, bench/gpu/run.sh does this with checkouts in .peers/): the peers on torch's
CUDA device, ours on JAX's GPU backend, `--dtype bfloat16` (or float32 with full-precision dots on
both sides: JAX's "highest" matmul precision, torch's allow_tf32 off). The `8b-4l` model has
LLaDA-8B's widths and vocabulary with 4 of its 32 layers (1.9 B params). dInfer's fastest path
(decoding/diffusion_runner.py: torch.compile + CUDA graphs) imports SGLang, which the GPU image does
not have: its eager BlockWiseDiffusionLLM (the one above) is what runs.

Threads: `--threads` (default 2, as bench/compare_torch.py) pins the process and sets torch's
threads. On a box whose cores are shared with other busy processes use `--threads 1`: torch's
OpenMP regions then wait on a descheduled second thread and the peers slow down 10-70x (RESULTS.md).
"""
from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import types

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from bench.compare_torch import pin_threads, random_params, random_prompts  # noqa: E402

FAST_DLLM_FILES = ("llada/generate.py", "llada/model/modeling_llada.py")
DINFER_FILES = ("python/dinfer/decoding/generate_uniform.py", "python/dinfer/model/modeling_llada.py")

MODELS = {
    "medium": dict(vocab_size=32000, hidden_size=1024, num_layers=8, num_heads=16, num_kv_heads=16, head_dim=64,
                   intermediate_size=2816, mask_token_id=31999, eos_token_id=31998, pad_token_id=31998,
                   eot_token_id=31997),
    # LLaDA-8B's layer widths and vocabulary, 4 of its 32 layers (1.9 B params): for accelerators.
    "8b-4l": dict(vocab_size=126464, hidden_size=4096, num_layers=4, num_heads=32, num_kv_heads=32, head_dim=128,
                  intermediate_size=12288, mask_token_id=126336, eos_token_id=126081, pad_token_id=126081,
                  eot_token_id=126348),
    "tiny": dict(vocab_size=100, hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=8, head_dim=32,
                 intermediate_size=512, mask_token_id=1, eos_token_id=0, pad_token_id=0, eot_token_id=2),
}

SHIMS: list[str] = []


def check_checkout(path: str | None, name: str, files, url: str) -> str | None:
    """None when not given; else the absolute path, or SystemExit with what is missing."""
    if path is None:
        return None
    path = os.path.abspath(path)
    missing = [f for f in files if not os.path.isfile(os.path.join(path, f))]
    if not os.path.isdir(path) or missing:
        raise SystemExit(f"--{name.lower()} {path}: not a checkout of {url} (missing "
                         f"{', '.join(missing) if os.path.isdir(path) else 'the folder itself'}); "
                         f"clone it (git clone https://github.com/{url}) and pass its root")
    return path


def git_commit(path: str) -> str | None:
    try:
        return subprocess.run(["git", "-C", path, "rev-parse", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip() or None
    except Exception:
        return None


# ---------------------------------------------------------------------------------------------
# The peers


def load_llada(modeling, hf_dir: str, who: str, device: str = "cpu", dtype: str = "float32"):
    """The peer's own LLaDAModelLM from our HF export, in `dtype` on `device`. Not `from_pretrained`: under
    transformers 5 it fails for both peers' classes (written for transformers 4.x: no post_init, so
    `all_tied_weights_keys` is missing), and dInfer's __init__ would put the model on CUDA. Instead:
    their LLaDAConfig.from_pretrained, their create_model_config_from_pretrained_config, their
    LLaDAModel(init_device='cpu', init_params=False) passed to LLaDAModelLM(config, model=...), and
    every exported tensor by load_state_dict (checked: none missing, none unexpected)."""
    import torch
    from safetensors.torch import load_file
    hf_config = modeling.LLaDAConfig.from_pretrained(hf_dir)
    mcfg = modeling.create_model_config_from_pretrained_config(hf_config)
    mcfg.init_device = "cpu"
    model = modeling.LLaDAModelLM(hf_config, model=modeling.LLaDAModel(mcfg, init_params=False))
    state = {}
    for f in sorted(os.listdir(hf_dir)):
        if f.endswith(".safetensors"):
            state.update(load_file(os.path.join(hf_dir, f)))
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise RuntimeError(f"{who} LLaDAModelLM did not load every tensor: missing {missing}, "
                           f"unexpected {unexpected}")
    return model.to(device=device, dtype=getattr(torch, dtype)).eval()


class FastDLLMSide:
    name = "fast-dllm"
    early_stop = False  # generate_with_dual_cache decodes every block

    def __init__(self, checkout: str, hf_dir: str, cfg, threshold: float, device: str = "cpu",
                 dtype: str = "float32"):
        import torch
        sys.path.insert(0, os.path.join(checkout, "llada"))
        try:
            gen = importlib.import_module("generate")  # llada/generate.py (imports model.modeling_llada)
        finally:
            sys.path.pop(0)
        self.torch, self.fn = torch, gen.generate_with_dual_cache
        modeling = sys.modules["model.modeling_llada"]
        self.model = load_llada(modeling, hf_dir, "Fast-dLLM", device, dtype)
        self.cfg, self.threshold, self.device = cfg, threshold, device

    def generate(self, prompt, gen_length, block_length):
        x, nfe = self.fn(self.model, self.torch.tensor([prompt], device=self.device), steps=gen_length, gen_length=gen_length,
                         block_length=block_length, temperature=0.0, remasking="low_confidence",
                         mask_id=self.cfg.mask_token_id, threshold=self.threshold)
        return x[0, len(prompt):].tolist(), int(nfe)


def import_dinfer(checkout: str):
    """dInfer's submodules without its package __init__ files (which import vllm); vllm.distributed's
    two tensor-parallel queries stubbed for a single process."""
    pkg_root = os.path.join(checkout, "python", "dinfer")
    for name, sub in (("dinfer", ""), ("dinfer.model", "model"), ("dinfer.decoding", "decoding")):
        if name not in sys.modules:
            m = types.ModuleType(name)
            m.__path__ = [os.path.join(pkg_root, sub) if sub else pkg_root]
            sys.modules[name] = m
    SHIMS.append("dInfer package __init__ files bypassed (dinfer/__init__.py -> decoding/serving.py imports vllm; "
                 "dinfer/model/__init__.py imports modeling_fused_olmoe.py -> vllm fused_moe)")
    if "vllm" not in sys.modules:
        try:
            importlib.import_module("vllm.distributed")
            SHIMS.append("vllm importable: real vllm.distributed used")
        except ImportError:
            vllm, dist = types.ModuleType("vllm"), types.ModuleType("vllm.distributed")
            dist.get_tensor_model_parallel_rank = lambda: 0
            dist.get_tensor_model_parallel_world_size = lambda: 1
            vllm.distributed = dist
            sys.modules["vllm"], sys.modules["vllm.distributed"] = vllm, dist
            SHIMS.append("vllm.distributed stub: get_tensor_model_parallel_rank() -> 0, "
                         "get_tensor_model_parallel_world_size() -> 1 (construction only: LLaDABlock.__init__)")
    modeling = importlib.import_module("dinfer.model.modeling_llada")
    uniform = importlib.import_module("dinfer.decoding.generate_uniform")
    strategy = importlib.import_module("dinfer.decoding.parallel_strategy")
    utils = importlib.import_module("dinfer.decoding.utils")
    return modeling, uniform, strategy, utils


class DInferSide:
    name = "dinfer"
    early_stop = True

    def __init__(self, checkout: str, hf_dir: str, cfg, threshold: float, device: str = "cpu",
                 dtype: str = "float32"):
        import torch
        modeling, uniform, strategy, utils = import_dinfer(checkout)
        SHIMS.append("dInfer LLaDAModelLM.__init__ hardcodes init_device='cuda' (modeling_llada.py, "
                     "LLaDAModelLM.__init__): built as for Fast-dLLM, with its LLaDAModel on init_device='cpu'")
        self.model = load_llada(modeling, hf_dir, "dInfer", device, dtype)
        self.torch, self.device = torch, device
        decoder = strategy.ThresholdParallelDecoder(temperature=0, threshold=threshold,
                                                    mask_id=cfg.mask_token_id, eos_id=cfg.eos_token_id)
        self.dllm = uniform.BlockWiseDiffusionLLM(self.model, decoder, utils.BlockIteratorFactory(),
                                                  cache_factory=utils.KVCacheFactory("dual"), early_stop=True)

    def generate(self, prompt, gen_length, block_length):
        before = self.dllm.num_forwards
        out = self.dllm.generate(self.torch.tensor([prompt], device=self.device), gen_length=gen_length, block_length=block_length)
        return out[0, len(prompt):].tolist(), int(self.dllm.num_forwards - before)


class JaxSide:
    def __init__(self, model, threshold: float, early_stop: bool):
        from dinfer_jax.engine import Generator
        self.gen, self.threshold, self.early_stop = Generator(model), threshold, early_stop
        self.name = f"dinfer-jax (early_stop={early_stop})"

    def generate(self, prompt, gen_length, block_length):
        import numpy as np
        from dinfer_jax import SamplingParams
        sp = SamplingParams(gen_length=gen_length, block_length=block_length, strategy="threshold", cache="dual",
                            threshold=self.threshold, temperature=0.0, early_stop=self.early_stop)
        r = self.gen.generate([np.asarray(prompt, np.int32)], sp)
        return r.raw_ids[0].tolist(), int(r.nfe[0])


# ---------------------------------------------------------------------------------------------


def build_checkpoint(kind: str, head_scale: float, work: str, dtype: str = "float32"):
    """-> (dinfer-jax checkpoint folder, HF export folder, ModelConfig). Weights drawn in fp32, stored
    in `dtype` (bfloat16 halves the files of the accelerator-sized model)."""
    from converters import export
    from dinfer_jax import checkpoint as ckpt
    from dinfer_jax import preset
    from dinfer_jax.families import to_hf_dict
    cfg = preset("tiny-dense").replace(rope_theta=10000.0, max_position_embeddings=4096, **MODELS[kind])
    params = random_params(cfg, seed=0)
    params["lm_head/unembedding"] *= head_scale
    params["lm_head/unembedding"][cfg.mask_token_id] = 0.0  # nobody predicts [MASK]
    if dtype != "float32":
        import ml_dtypes
        params = {k: v.astype(getattr(ml_dtypes, dtype)) for k, v in params.items()}
    dst, hf = os.path.join(work, kind, "ckpt"), os.path.join(work, kind, "hf")
    ckpt.save_params(dst, params, to_hf_dict(cfg))
    export(dst, hf, progress=False)
    return dst, hf, cfg


def strip_eos(tokens, eos_id):
    return [t for t in tokens if t != eos_id]


def run_round(side, prompts, gen_length, block_length):
    outs, nfes = [], []
    t = time.perf_counter()
    for p in prompts:
        o, n = side.generate(p, gen_length, block_length)
        outs.append(o)
        nfes.append(n)
    return time.perf_counter() - t, outs, nfes


def first_divergence(peer_outs, our_outs, eos_id):
    """None, or (prompt index, position in the EOS-stripped generation, peer token, our token)."""
    for i, (a, b) in enumerate(zip(peer_outs, our_outs)):
        a, b = strip_eos(a, eos_id), strip_eos(b, eos_id)
        if a != b:
            pos = next((k for k, (u, v) in enumerate(zip(a, b)) if u != v), min(len(a), len(b)))
            return i, pos, (a[pos] if pos < len(a) else None), (b[pos] if pos < len(b) else None)
    return None


def margin_at(model, cfg, prompt, our_out, pos_stripped, threshold):
    """Where the peers' tokens and ours first differ: how close the decision was, from OUR model's
    full forward on our final canvas with that one position re-masked (an approximation of the
    state at the deciding step, whose cached K/V is not kept): top-1 minus top-2 logit there, and
    the top-1 confidence minus tau. Never raises (a failure is recorded as text)."""
    try:
        import numpy as np
        idx = [k for k, t in enumerate(our_out) if t != cfg.eos_token_id]
        p = idx[pos_stripped] if pos_stripped < len(idx) else len(our_out) - 1
        canvas = np.asarray(list(prompt) + list(our_out), np.int32)
        canvas[len(prompt) + p] = cfg.mask_token_id
        lg = model.logits(canvas)[len(prompt) + p].astype(np.float64)
        top = np.sort(lg)[::-1]
        conf = float(np.exp(top[0] - np.logaddexp.reduce(lg)))
        return {"raw_position": p, "top1_minus_top2_logit": float(top[0] - top[1]),
                "conf_minus_tau": conf - threshold}
    except Exception as e:  # a diagnostic only
        return {"error": repr(e)}


def spread(v):
    return {"median": statistics.median(v), "min": min(v), "max": max(v), "all": v}


def compare(peer, ours, prompts, gen_length, block_length, repeats, cfg) -> dict:
    sides = {"peer": peer, "jax": ours}
    res = {k: run_round(s, prompts, gen_length, block_length) for k, s in sides.items()}  # warm-up / compile
    divergences = []

    def note(round_, d):
        m = margin_at(ours.gen.model, cfg, prompts[d[0]], res["jax"][1][d[0]], d[1], ours.threshold)
        divergences.append(dict(zip(("round", "prompt", "position", "peer_token", "our_token"), (round_,) + d),
                                margin=m))
    d = first_divergence(res["peer"][1], res["jax"][1], cfg.eos_token_id)
    if d:
        note("warm-up", d)
    times = {"peer": [], "jax": []}
    for r in range(repeats):
        for k in (("peer", "jax") if r % 2 == 0 else ("jax", "peer")):
            res[k] = run_round(sides[k], prompts, gen_length, block_length)
            times[k].append(res[k][0])
        d = first_divergence(res["peer"][1], res["jax"][1], cfg.eos_token_id)
        if d:
            note(r, d)
    tokens = {k: sum(len(strip_eos(o, cfg.eos_token_id)) for o in res[k][1]) for k in res}
    nfe = {k: sum(res[k][2]) for k in res}
    med = {k: statistics.median(v) for k, v in times.items()}
    row = {"peer": peer.name, "ours": ours.name, "gen_length": gen_length, "block_length": block_length,
           "prompts": len(prompts), "identical_tokens": not divergences,
           "divergences": divergences,
           "tokens_peer": tokens["peer"], "tokens_jax": tokens["jax"], "nfe_peer": nfe["peer"], "nfe_jax": nfe["jax"],
           "nfe_per_prompt_peer": res["peer"][2], "nfe_per_prompt_jax": res["jax"][2],
           "peer_s": spread(times["peer"]), "jax_s": spread(times["jax"]),
           "peer_tok_s": tokens["peer"] / med["peer"], "jax_tok_s": tokens["jax"] / med["jax"],
           "peer_fwd_s": nfe["peer"] / med["peer"], "jax_fwd_s": nfe["jax"] / med["jax"]}
    row["ratio_tok_s"] = row["jax_tok_s"] / row["peer_tok_s"]
    row["ratio_fwd_s"] = row["jax_fwd_s"] / row["peer_fwd_s"]
    row["ratio_nfe"] = nfe["peer"] / max(nfe["jax"], 1)
    return row


def print_row(model: str, r: dict):
    ok = "identical tokens" if r["identical_tokens"] else f"DIVERGED: {r['divergences'][0]}"
    print(f"[{model}] {r['peer']} vs {r['ours']}: {ok}")
    print(f"  seconds  peer {r['peer_s']['median']:.3f} [{r['peer_s']['min']:.3f}, {r['peer_s']['max']:.3f}]  "
          f"jax {r['jax_s']['median']:.3f} [{r['jax_s']['min']:.3f}, {r['jax_s']['max']:.3f}]")
    print(f"  tokens/s ours/peer = {r['jax_tok_s']:.1f}/{r['peer_tok_s']:.1f} = {r['ratio_tok_s']:.2f}x")
    print(f"  forwards/s ours/peer = {r['jax_fwd_s']:.1f}/{r['peer_fwd_s']:.1f} = {r['ratio_fwd_s']:.2f}x")
    print(f"  NFE peer/ours = {r['nfe_peer']}/{r['nfe_jax']} = {r['ratio_nfe']:.2f}x", flush=True)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--fast-dllm", help="root of a checkout of github.com/NVlabs/Fast-dLLM")
    ap.add_argument("--dinfer", help="root of a checkout of github.com/inclusionAI/dInfer")
    ap.add_argument("--models", default="medium,tiny", help="comma list of medium, tiny")
    ap.add_argument("--gen-length", type=int, default=64)
    ap.add_argument("--block-length", type=int, default=32)
    ap.add_argument("--threshold", type=float, default=0.9)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--num-prompts", type=int, default=4)
    ap.add_argument("--head-scale", type=float, default=40.0)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None,
                    help="CPU threads for XLA:CPU and torch, process pinned (default 2 on cpu; not pinned on cuda)")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                    help="cuda: the peers on torch's GPU, ours on JAX's default (GPU) backend")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                    help="weights and compute of every side; float32 matmuls at full precision on both sides")
    ap.add_argument("--out", help="write the rows, versions and peer commits here (JSON)")
    a = ap.parse_args(argv)
    if not a.fast_dllm and not a.dinfer:
        ap.error("give --fast-dllm PATH and/or --dinfer PATH (checkouts of github.com/NVlabs/Fast-dLLM and "
                 "github.com/inclusionAI/dInfer); the peers are not vendored")
    a.fast_dllm = check_checkout(a.fast_dllm, "fast-dllm", FAST_DLLM_FILES, "NVlabs/Fast-dLLM")
    a.dinfer = check_checkout(a.dinfer, "dinfer", DINFER_FILES, "inclusionAI/dInfer")
    if a.threads is None and a.device == "cpu":
        a.threads = 2
    bad = set(a.models.split(",")) - set(MODELS)
    if bad:
        ap.error(f"unknown models {sorted(bad)}; choose from {', '.join(MODELS)}")
    return a


def versions() -> dict:
    import jax
    import torch
    import transformers
    return {"jax": jax.__version__, "torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version()}


def main(argv=None):
    args = parse_args(argv)
    if args.threads:
        pin_threads(args.threads)
    import jax
    import jax.numpy as jnp
    import torch
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device == "cuda":
        if not torch.cuda.is_available() or jax.default_backend() != "gpu":
            raise SystemExit(f"--device cuda: torch sees a GPU: {torch.cuda.is_available()}, JAX backend: "
                             f"{jax.default_backend()}")
        if args.dtype == "float32":
            # fp32 at full precision on both sides: JAX's default lets XLA:GPU use TF32 for fp32 dots;
            # torch's matmul default (allow_tf32 False) does not. (Not for bf16: "highest" would upcast.)
            jax.config.update("jax_default_matmul_precision", "highest")
            torch.backends.cuda.matmul.allow_tf32 = False
        print(f"GPU: torch {torch.cuda.get_device_name()}, jax {jax.devices()[0]}", flush=True)
    from dinfer_jax import load_model
    commits = {"fast-dllm": git_commit(args.fast_dllm) if args.fast_dllm else None,
               "dinfer": git_commit(args.dinfer) if args.dinfer else None}
    rows = {}
    with tempfile.TemporaryDirectory(prefix="compare_peers_") as work:
        for kind in args.models.split(","):
            t = time.perf_counter()
            folder, hf, cfg = build_checkpoint(kind, args.head_scale, work, args.dtype)
            print(f"[{kind}] checkpoint + HF export ({args.dtype}): {time.perf_counter() - t:.1f} s", flush=True)
            model = load_model(folder, dtype=getattr(jnp, args.dtype))
            prompts = random_prompts(cfg, args.num_prompts, args.prompt_len, seed=0)
            peers = []
            if args.fast_dllm:
                peers.append(FastDLLMSide(args.fast_dllm, hf, cfg, args.threshold, args.device, args.dtype))
            if args.dinfer:
                peers.append(DInferSide(args.dinfer, hf, cfg, args.threshold, args.device, args.dtype))
            if kind == args.models.split(",")[0]:
                print("peer shims:", *SHIMS, sep="\n  ", flush=True)
            rows[kind] = []
            with torch.inference_mode():
                for peer in peers:
                    ours = JaxSide(model, args.threshold, peer.early_stop)
                    r = compare(peer, ours, prompts, args.gen_length, args.block_length, args.repeats, cfg)
                    print_row(kind, r)
                    rows[kind].append(r)
    if args.out:
        record = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  "command": " ".join(["bench/compare_peers.py"] + (list(argv) if argv is not None else sys.argv[1:])),
                  "peer_commits": commits, "peer_shims": SHIMS, "versions": versions(), "threads": args.threads,
                  "device": args.device, "dtype": args.dtype,
                  "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None,
                  "cpus": sorted(os.sched_getaffinity(0)),
                  "models": {k: MODELS[k] for k in rows}, "head_scale": args.head_scale,
                  "prompt_len": args.prompt_len, "num_prompts": args.num_prompts, "repeats": args.repeats,
                  "rows": rows}
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)
    return rows


if __name__ == "__main__":
    main()

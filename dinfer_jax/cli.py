"""The `dinfer-jax` command line.

  dinfer-jax convert SRC_HF_DIR DST_DIR [--dtype bfloat16|float16|float32]
  dinfer-jax export DIR HF_DIR
  dinfer-jax info MODEL_DIR
  dinfer-jax logits --model DIR --prompt-ids 1,2,3 [--json]
  dinfer-jax generate --model DIR (--prompt TEXT | --prompt-ids 1,2,3) [--gen-length N] [--block-length B]
      [--strategy S] [--threshold T] [--steps N] [--cache C] [--temperature T] [--seed S] [--json]
  dinfer-jax demo [--workdir DIR]

Errors caused by the user's input print one line `dinfer-jax: error: ...` and exit 2.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

DTYPES = ("bfloat16", "float16", "float32")


def _parse_ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--prompt-ids must be comma-separated integers, got {text!r}") from None
    if not ids:
        raise argparse.ArgumentTypeError("--prompt-ids is empty")
    return ids


def _np_dtype(name):
    import ml_dtypes
    import numpy as np
    return None if name is None else np.dtype(ml_dtypes.bfloat16 if name == "bfloat16" else name)


def cmd_convert(a):
    from converters import convert
    t = time.perf_counter()
    out = convert(a.src, a.dst, dtype=_np_dtype(a.dtype), progress=not a.quiet)
    print(f"wrote {len(out)} parameters to {a.dst} in {time.perf_counter() - t:.1f}s")


def cmd_export(a):
    from converters import export
    export(a.src, a.dst, progress=not a.quiet)
    print(f"exported {a.src} to {a.dst}")


def cmd_info(a):
    from dinfer_jax import checkpoint as ckpt
    from dinfer_jax.config import load_hf_config
    if not os.path.isdir(a.model):
        raise FileNotFoundError(f"model folder {a.model!r} does not exist")
    cfg = load_hf_config(a.model)
    kind = "dinfer-jax checkpoint" if ckpt.is_checkpoint(a.model) else "Hugging Face folder"
    print(json.dumps({"folder": a.model, "kind": kind, "num_params": cfg.num_params, **cfg.to_dict()}, indent=1))


def cmd_logits(a):
    import numpy as np
    from dinfer_jax import load_model
    model = load_model(a.model)
    lg = model.logits(np.asarray(a.prompt_ids))
    top = lg.argmax(-1).tolist()
    if a.json:
        print(json.dumps({"argmax": top, "max_logit": float(lg.max()), "shape": list(lg.shape)}))
    else:
        print(f"logits shape {lg.shape}; argmax per position: {top}")


def _positive(text):
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if v <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {v}")
    return v


def cmd_generate(a):
    import numpy as np
    from dinfer_jax import SamplingParams, generate, load_model
    if a.model is None:
        raise ValueError("--model is required (the built-in demo model does not exist yet)")
    model = load_model(a.model)
    tok = None
    tok_path = os.path.join(a.model, "tokenizer.json")
    if a.prompt is not None:
        if not os.path.isfile(tok_path):
            raise ValueError(f"--prompt needs {tok_path}; pass --prompt-ids instead")
        from tokenizers import Tokenizer
        tok = Tokenizer.from_file(tok_path)
        ids = tok.encode(a.prompt, add_special_tokens=False).ids
    else:
        ids = a.prompt_ids
        if os.path.isfile(tok_path):
            from tokenizers import Tokenizer
            tok = Tokenizer.from_file(tok_path)
    sp = SamplingParams(gen_length=a.gen_length, block_length=a.block_length, strategy=a.strategy,
                        threshold=a.threshold, low_threshold=a.low_threshold, factor=a.factor, steps=a.steps,
                        cache=a.cache, temperature=a.temperature, seed=a.seed, smoothing=a.smoothing,
                        early_stop=not a.no_early_stop)
    r = generate(model, [np.asarray(ids)], sp)
    text = tok.decode(r.token_ids[0]) if tok is not None else None
    out = {"token_ids": r.token_ids[0], "text": text, "nfe": r.nfe[0], "tpf": round(r.tpf[0], 3),
           "seconds": round(r.seconds, 4)}
    if a.json:
        print(json.dumps(out))
    else:
        print(text if text is not None else " ".join(map(str, r.token_ids[0])))
        print(f"[{len(r.token_ids[0])} tokens, {r.nfe[0]} forwards, {r.tpf[0]:.2f} tokens/forward, "
              f"{r.seconds:.2f}s incl. compile]", file=sys.stderr)


def cmd_demo(a):
    """Tiny random LLaDA-MoE: save -> export as HF safetensors -> convert back -> forward; the logits
    of the reloaded model must equal the original's bit for bit."""
    import jax
    import numpy as np
    from converters import convert, export
    from dinfer_jax import checkpoint as ckpt
    from dinfer_jax.config import preset, to_hf_dict
    from dinfer_jax.model import Model
    from dinfer_jax.models import init_params

    work = a.workdir or tempfile.mkdtemp(prefix="dinfer-jax-demo-")
    cfg = preset("tiny")
    params = init_params(cfg, seed=0)
    print(f"tiny LLaDA-MoE (random weights): {cfg.num_params:,} params, {cfg.num_experts} experts "
          f"top-{cfg.num_experts_per_tok}, jax {jax.__version__} on {jax.default_backend()}")
    ckpt.save_params(os.path.join(work, "original"), params, to_hf_dict(cfg))
    export(os.path.join(work, "original"), os.path.join(work, "hf"), progress=False)
    convert(os.path.join(work, "hf"), os.path.join(work, "converted"), progress=False)
    from dinfer_jax import load_model
    reloaded = load_model(os.path.join(work, "converted"))
    ids = np.arange(1, 17) % cfg.vocab_size
    a_logits = Model(cfg, params).logits(ids)
    b_logits = reloaded.logits(ids)
    same = bool(np.array_equal(a_logits, b_logits))
    print(f"HF export + convert round trip in {work}: logits identical = {same}")
    print(f"argmax per position: {b_logits.argmax(-1).tolist()}")
    if not same:
        raise SystemExit("demo failed: logits differ after the round trip")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dinfer-jax", description="Inference for masked-diffusion LMs in JAX.")
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("convert", help="HF folder (safetensors / .bin, sharded or not, dInfer fused) -> "
                                       "dinfer-jax checkpoint")
    c.add_argument("src")
    c.add_argument("dst")
    c.add_argument("--dtype", choices=DTYPES, default=None, help="cast params (default: keep the checkpoint's)")
    c.add_argument("--quiet", action="store_true")
    c.set_defaults(fn=cmd_convert)
    e = sub.add_parser("export", help="dinfer-jax checkpoint -> HF safetensors folder")
    e.add_argument("src")
    e.add_argument("dst")
    e.add_argument("--quiet", action="store_true")
    e.set_defaults(fn=cmd_export)
    i = sub.add_parser("info", help="print the config of a model folder")
    i.add_argument("model")
    i.set_defaults(fn=cmd_info)
    lg = sub.add_parser("logits", help="one full bidirectional forward; prints the argmax per position")
    lg.add_argument("--model", required=True)
    lg.add_argument("--prompt-ids", type=_parse_ids, required=True)
    lg.add_argument("--json", action="store_true")
    lg.set_defaults(fn=cmd_logits)
    g = sub.add_parser("generate", help="diffusion decoding of one prompt (the whole schedule in one jitted loop)")
    g.add_argument("--model", default=None, help="dinfer-jax checkpoint or HF folder")
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", default=None, help="text (needs tokenizer.json in the model folder)")
    src.add_argument("--prompt-ids", type=_parse_ids, default=None)
    g.add_argument("--gen-length", type=_positive, default=128)
    g.add_argument("--block-length", type=_positive, default=64)
    g.add_argument("--strategy", choices=("fixed", "random", "threshold", "factor", "credit", "hierarchy"),
                   default="threshold")
    g.add_argument("--threshold", type=float, default=0.9)
    g.add_argument("--low-threshold", type=float, default=0.4, help="hierarchy: per-run threshold")
    g.add_argument("--factor", type=float, default=1.0, help="factor strategy's f")
    g.add_argument("--steps", type=_positive, default=None, help="fixed/random: total steps (default gen-length)")
    g.add_argument("--cache", choices=("none", "prefix", "dual", "vicinity"), default="dual")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--smoothing", action="store_true", help="iteration smoothing (soft mask embeddings)")
    g.add_argument("--no-early-stop", action="store_true")
    g.add_argument("--json", action="store_true", help="print one JSON object: token_ids, text, nfe, tpf, seconds")
    g.set_defaults(fn=cmd_generate)
    d = sub.add_parser("demo", help="tiny random LLaDA-MoE: export, convert back, forward, compare")
    d.add_argument("--workdir", default=None)
    d.set_defaults(fn=cmd_demo)
    return p


def main(argv=None):
    args = build_parser().parse_args(argv)
    from converters.errors import ConversionError
    from dinfer_jax.config import ConfigError
    try:
        args.fn(args)
    except (ConversionError, ConfigError, FileNotFoundError, FileExistsError, ValueError) as e:
        print(f"dinfer-jax: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()

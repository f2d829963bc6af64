"""The `dinfer-jax` command line.

  dinfer-jax convert SRC_HF_DIR DST_DIR [--dtype bfloat16|float16|float32]
  dinfer-jax export DIR HF_DIR
  dinfer-jax info MODEL_DIR
  dinfer-jax logits --model DIR --prompt-ids 1,2,3 [--json]
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

"""The `dinfer-jax` command line.

  dinfer-jax convert SRC_HF_DIR DST_DIR [--dtype bfloat16|float16|float32] [--quantize int8|fp8] [--overwrite]
  dinfer-jax export DIR HF_DIR [--max-shard-size 5GB] [--overwrite]
      (both write a temporary sibling folder and rename it into place when complete)
  dinfer-jax info MODEL_DIR
  dinfer-jax logits --model DIR --prompt-ids 1,2,3 [--json]
  dinfer-jax generate [--model DIR] (--prompt TEXT | --prompt-ids 1,2,3) [--gen-length N] [--block-length B]
      [--strategy S] [--threshold T] [--steps N] [--cache C] [--temperature T] [--seed S] [--json]
      (without --model: the built-in demo model, dinfer_jax/demo_model)
  dinfer-jax generate [--model DIR] --prompts-file FILE [--batch-size N] [--json] ...   (one line per prompt)
  dinfer-jax chat [--model DIR] [--system TEXT] [--show-prompt] [--no-stream] ...   (stdin lines; /reset, /exit)
  every --model may be a Hugging Face Hub id ORG/NAME (dinfer_jax/hub.py: downloaded, or cached offline)
  dinfer-jax eval demo|jsonl|humaneval [--model DIR] [--data FILE] [--n N] [--strategy LIST] [--cache LIST] [--out DIR]
  dinfer-jax train [--out DIR] [--workdir W] [--steps N] ...   (= python -m dinfer_jax.train)
  dinfer-jax lm-eval run --model dinfer_jax --model_args pretrained=DIR --tasks T ...   (lm_eval CLI)
  dinfer-jax serve [--model DIR] [--host H] [--port P] [--max-batch N] [--strategy S] [--threshold T] ...
  dinfer-jax bench [--model DIR] [--batch 1,4,16] [--strategies threshold,credit] [--caches dual,none] [--json]
  dinfer-jax profile [--model DIR] (--prompt TEXT | --prompt-ids 1,2,3) --logdir DIR [--repeats N]
  generate / logits / serve / bench / profile also take --mesh "data=2,expert=4" and, on several hosts,
  --coordinator HOST:PORT --num-processes N --process-id I (process 0 prints the results)
  dinfer-jax demo [--workdir DIR]   (without --workdir: a temporary folder, removed afterwards)
  A model folder argument (MODEL_DIR, DIR, --model) may also be 'demo' or 'demo-block', the built-in
  demo models (checkpoint.MODEL_ALIASES).

Errors caused by the user's input print one line `dinfer-jax: error: ...` and exit 2 (a bad
decoding setting names its flag; the rules themselves live in decoding/spec.py); Ctrl-C
prints one line and exits 130.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time
import warnings

from dinfer_jax.decoding.rows import ids_until_stop
from dinfer_jax.decoding.spec import (BLOCK_GROUP, BOOL, CACHES, CHOICE, EDIT_MODES, GENERAL, GROUP_TITLES, INT,
                                      SETTINGS, STRATEGIES, InvalidParam, flag_name)

DTYPES = ("bfloat16", "float16", "float32")
MODEL_HELP = ("dinfer-jax checkpoint or HF folder, or 'demo' / 'demo-block' (the built-in demo models; "
              "default: demo)")


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
    out = convert(a.src, a.dst, dtype=_np_dtype(a.dtype), progress=not a.quiet, overwrite=a.overwrite,
                  quantize=a.quantize)
    print(f"wrote {len(out)} parameters to {a.dst} in {time.perf_counter() - t:.1f}s")


def _shard_size(text):
    from converters.safetensors_io import parse_size
    try:
        parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def cmd_export(a):
    from converters import export
    files = export(a.src, a.dst, progress=not a.quiet, overwrite=a.overwrite, max_shard_size=a.max_shard_size)
    print(f"exported {a.src} to {a.dst} ({len(files)} safetensors file{'s' if len(files) > 1 else ''})")


def cmd_info(a):
    from dinfer_jax import checkpoint as ckpt
    from dinfer_jax.families import load_hf_config
    folder = ckpt.check_model_folder(a.model)
    cfg = load_hf_config(folder)
    kind = "dinfer-jax checkpoint" if ckpt.is_checkpoint(folder) else "Hugging Face folder"
    quant = sorted({m["kind"] for m in (ckpt.read_manifest(folder).get("quantization") or {}).values()}
                   if ckpt.is_checkpoint(folder) else [])
    print(json.dumps({"folder": folder, "kind": kind, "num_params": cfg.num_params,
                      "quantization": "+".join(quant) or None, **cfg.to_dict(),
                      "decoding_defaults": _decoding_summary(_model_defaults(folder))}, indent=1))


def _decoding_summary(sp) -> dict:
    """The settings `generate` uses on this folder with no flags: gen_length, block_length,
    strategy, cache and every field that differs from SamplingParams()'s."""
    import dataclasses
    from dinfer_jax import SamplingParams
    plain = SamplingParams()
    return {f.name: getattr(sp, f.name) for f in dataclasses.fields(sp)
            if f.name in ("gen_length", "block_length", "strategy", "cache")
            or getattr(sp, f.name) != getattr(plain, f.name)}


def cmd_plan(a):
    import jax
    jax.config.update("jax_platforms", "cpu")  # compile-only TPU devices come from libtpu, not a backend
    from dinfer_jax import checkpoint as ckpt
    from dinfer_jax import plan
    from dinfer_jax.families import load_hf_config, preset
    from dinfer_jax.engine import SamplingParams
    from dinfer_jax.families import diffusion_gemma as dgf
    if (a.model is not None and dgf.is_folder(ckpt.check_model_folder(a.model))) or a.preset in dgf.PRESETS:
        return _plan_diffusion_gemma(a)
    cfg = load_hf_config(ckpt.check_model_folder(a.model)) if a.model is not None else preset(a.preset)
    over = {k: v for k, v in (("gen_length", a.gen_length), ("block_length", a.block_length), ("cache", a.cache))
            if v is not None}
    if cfg.attention_mask == "block_causal" and "cache" not in over:
        over["cache"] = "block"
    out = plan.plan(cfg, a.topology, a.mesh, find_batch=not a.no_find_batch, every_mesh=a.every_mesh,
                    batch=a.batch, prompt_len=a.prompt_len,
                    sampling=SamplingParams.for_model(cfg, **over), quantize=a.quantize, programs=a.programs,
                    tpf=a.tpf)
    print(json.dumps(out) if a.json else plan.format_table(out))


def _plan_diffusion_gemma(a):
    """`plan` for DiffusionGemma (families/diffusion_gemma_plan.py): the generate program for --batch
    prompts of --prompt-len tokens and --gen-length new tokens (default: one canvas) on --mesh
    (default: the experts over every device)."""
    from dinfer_jax import plan
    from dinfer_jax.families import diffusion_gemma as dgf
    from dinfer_jax.families import diffusion_gemma_plan as dgp
    given = [n for n, default in (("block_length", None), ("cache", None), ("quantize", None),
                                  ("programs", "generate"), ("tpf", 1.0), ("no_find_batch", False))
             if getattr(a, n) != default]
    if given:
        raise plan.PlanError(f"DiffusionGemma plan: {', '.join('--' + n.replace('_', '-') for n in given)} "
                             f"{'does' if len(given) == 1 else 'do'} not apply (it takes --mesh, --batch, --prompt-len "
                             "and --gen-length)")
    if a.model is not None:
        with open(os.path.join(a.model, "config.json")) as f:
            cfg, canvas = dgf.config_from_hf(json.load(f))
    else:
        cfg, canvas = dgf.preset(a.preset)
    out = dgp.compile_plan(cfg, canvas, a.topology, a.mesh, batch=a.batch, prompt_len=a.prompt_len,
                           max_new_tokens=a.gen_length or canvas)
    if a.json:
        print(json.dumps(out))
    else:
        b = out["per_chip_bytes"]
        gib = lambda x: f"{x / 2**30:.2f} GiB"
        print(f"DiffusionGemma on {out['topology']} ({out['device_kind']}, {out['devices']} devices), mesh "
              f"{out['mesh']}, batch {out['batch']}, prompt {out['prompt_len']}, {out['canvases']} canvas(es) of "
              f"{out['canvas_length']}: per chip {gib(b['arguments'])} arguments + {gib(b['temp'])} temp = "
              f"{gib(b['total'])} of {gib(out['hbm_bytes'])}: {'fits' if out['fits'] else 'does NOT fit'} "
              f"(compiled in {out['compile_seconds']} s)")


def cmd_logits(a):
    import numpy as np
    from dinfer_jax.checkpoint import check_model_folder
    model = _load_model(a, check_model_folder(a.model))
    lg = model.logits(np.asarray(a.prompt_ids))
    if not _is_main_process():
        return
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


def _positive_list(text):
    try:
        vals = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}") from None
    if not vals or min(vals) <= 0:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}")
    return vals


def _port(text):
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, got {text!r}") from None
    if not 1 <= v <= 65535:
        raise argparse.ArgumentTypeError(f"port {v} is outside 1..65535")
    return v


def _nonneg_float(text):
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not v >= 0 or v == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {text!r}")
    return v


def _model_dir(a) -> str:
    """--model (a folder, or an alias: demo, demo-block), or the built-in demo model when it is omitted."""
    from dinfer_jax.checkpoint import DEMO_MODEL_DIR, check_model_folder, is_checkpoint
    if a.model is not None:
        return check_model_folder(a.model)
    if not is_checkpoint(DEMO_MODEL_DIR):
        raise FileNotFoundError(f"the built-in demo model is missing ({DEMO_MODEL_DIR}); pass --model, or train it: "
                                "python -m dinfer_jax.train --out dinfer_jax/demo_model")
    return DEMO_MODEL_DIR


def _warn_off_defaults(defaults: dict, model_dir: str, **chosen):
    """One stderr line when the chosen lengths differ from the model folder's generation defaults
    (the demo model, e.g., answers only in the 16-token region it was trained on)."""
    off = [f"--{k.replace('_', '-')} {v} (default {defaults[k]})" for k, v in chosen.items()
           if k in defaults and v != defaults[k]]
    if off:
        print(f"dinfer-jax: warning: {', '.join(off)}: not the generation defaults of this model "
              f"({os.path.join(model_dir, 'generation_config.json')}); it may not answer correctly", file=sys.stderr)


def _load_model(a, model_dir: str):
    """load_model with the scale flags: multi-host init (--coordinator ...) and --mesh."""
    from dinfer_jax import load_model, sharding
    sharding.initialize_distributed(getattr(a, "coordinator", None), getattr(a, "num_processes", None),
                                    getattr(a, "process_id", None))
    mesh = sharding.make_mesh(a.mesh) if getattr(a, "mesh", None) else None
    return load_model(model_dir, mesh=mesh)


def _prompt_ids(a, tok, model_dir: str) -> list[int]:
    if a.prompt is not None:
        if tok is None:
            raise ValueError(f"--prompt needs {os.path.join(model_dir, 'tokenizer.json')}; pass --prompt-ids instead")
        ids = tok.encode_prompt(a.prompt, "--prompt")
        if not ids:
            raise ValueError("--prompt is empty")
        return ids
    return a.prompt_ids


# The decoding flags: the SamplingParams fields that decoding/spec.SETTINGS marks `cli`.
_DECODING_FLAGS = tuple(n for n, s in SETTINGS.items() if s.cli)


def _explicit_flags(a) -> dict:
    """The decoding settings the user gave on the command line: the --edit-mode preset
    (decoding/spec.EDIT_MODES), then every explicit flag over it. Nothing else: the rest are the model's
    defaults (SamplingParams.for_model)."""
    out = dict(EDIT_MODES[a.edit_mode]) if getattr(a, "edit_mode", None) else {}
    for n in _DECODING_FLAGS:
        s, v = SETTINGS[n], getattr(a, _dest(n), None)
        if s.kind == BOOL and v:
            out[n] = s.cli_sets
        elif s.kind != BOOL and v is not None:
            out[n] = v
    return out


def _dest(name: str) -> str:
    """The argparse attribute of a decoding field's flag (--no-early-stop: no_early_stop)."""
    return flag_name(name)[2:].replace("-", "_")


def _model_defaults(model_dir: str, **overrides):
    """SamplingParams.for_model on the folder's config: the family's defaults, then the folder's
    generation_config.json, then `overrides` (a setting that contradicts the family warns)."""
    from dinfer_jax import SamplingParams
    from dinfer_jax.families import load_hf_config
    return SamplingParams.for_model(load_hf_config(model_dir), model_dir, **overrides)


def _sampling_params(a, model_dir: str):
    """The command's SamplingParams: the model's defaults with the explicit flags over them."""
    from dinfer_jax.checkpoint import generation_defaults
    sp = _model_defaults(model_dir, **_explicit_flags(a)).validate()
    _warn_off_defaults(generation_defaults(model_dir), model_dir, gen_length=sp.gen_length,
                       block_length=sp.block_length)
    return sp


def _add_model_and_prompt_flags(p):
    """--model and one of --prompt / --prompt-ids (the one-prompt commands)."""
    p.add_argument("--model", default=None, help=MODEL_HELP)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", default=None, help="text (needs tokenizer.json in the model folder)")
    src.add_argument("--prompt-ids", type=_parse_ids, default=None)
    return src


def _prompt_setup(a):
    """-> (model_dir, tokenizer or None, prompt ids, SamplingParams, Model) for one-prompt commands."""
    from dinfer_jax.tokenizer import has_tokenizer, load_tokenizer
    model_dir = _model_dir(a)
    tok = load_tokenizer(model_dir) if has_tokenizer(model_dir) else None
    ids = _prompt_ids(a, tok, model_dir)
    return model_dir, tok, ids, _sampling_params(a, model_dir), _load_model(a, model_dir)


def _is_main_process() -> bool:
    import jax
    return jax.process_index() == 0


def _add_compile_cache_flag(p):
    p.add_argument("--compile-cache", default=None, metavar="DIR",
                   help="JAX's persistent compilation cache folder, or 'off' (default: $DINFER_JAX_COMPILE_CACHE, "
                        "else ~/.cache/dinfer-jax/jax-compile): a second start reads its programs from disk")


def _diffusion_gemma_model(a, model_dir: str):
    """(settings, model) of a DiffusionGemma folder for generate / chat: its generation_config.json
    settings (the reference's defaults under them) with --gen-length as max_new_tokens, --steps as
    max_denoising_steps; loaded on --mesh (one host). ValueError naming the flags that do not apply."""
    from dinfer_jax import compile_cache, sharding
    from dinfer_jax.families import diffusion_gemma as dgf
    from dinfer_jax.families import read_generation_config
    given = [n for n in tuple(_dest(n) for n in _DECODING_FLAGS if n != "gen_length") + (
                 "edit_mode", "prompts_file", "show_canvas", "suffix", "infill", "json_schema", "json_object", "regex",
                 "choice", "span") if n not in ("steps", "seed") and getattr(a, n, None) not in (None, False)]
    if given:
        raise ValueError(f"{model_dir} is a DiffusionGemma model (uniform-noise diffusion, one prompt): "
                         f"{', '.join('--' + n.replace('_', '-') for n in given)} do not apply; it takes --gen-length "
                         "(max_new_tokens), --steps (max_denoising_steps), --seed and --mesh")
    if getattr(a, "coordinator", None) or getattr(a, "num_processes", None):
        raise ValueError(f"{model_dir} is a DiffusionGemma model: decoding over several hosts (--coordinator, "
                         f"--num-processes) is not built for it; --mesh places it on this host's devices")
    compile_cache.enable(a.compile_cache)
    settings = dgf.settings_from_generation_config(read_generation_config(model_dir))
    upd = {k: v for k, v in (("max_new_tokens", getattr(a, "gen_length", None)),
                             ("max_denoising_steps", getattr(a, "steps", None))) if v is not None}
    settings = dataclasses.replace(settings, **upd)
    return settings, dgf.load(model_dir, mesh=sharding.make_mesh(a.mesh) if getattr(a, "mesh", None) else None)


def _diffusion_gemma_answer(out, settings) -> list[int]:
    """A DiffusionGemma row's generated ids up to its first EOS (the rest is pad)."""
    kept = [int(x) for x in out]
    eos = [i for i, x in enumerate(kept) if x in settings.eos_token_id]
    return kept[:eos[0]] if eos else kept


def _generate_diffusion_gemma(a, model_dir: str):
    """`generate` on a DiffusionGemma folder (uniform-noise diffusion, families/diffusion_gemma.py):
    its generation_config.json settings (the reference's defaults under them), --gen-length as
    max_new_tokens, --steps as max_denoising_steps, --seed, --mesh (one host). The other decoding
    flags do not apply."""
    from dinfer_jax import sharding
    from dinfer_jax.families import diffusion_gemma as dgf
    from dinfer_jax.tokenizer import has_tokenizer, load_tokenizer
    settings, model = _diffusion_gemma_model(a, model_dir)
    tok = load_tokenizer(model_dir) if has_tokenizer(model_dir) else None
    ids = _prompt_ids(a, tok, model_dir)
    t = time.perf_counter()
    out = dgf.generate(model, [ids], settings, seed=a.seed or 0)[0]
    seconds = time.perf_counter() - t
    timed = None
    if a.timed:
        t = time.perf_counter()
        dgf.generate(model, [ids], settings, seed=a.seed or 0)
        timed = time.perf_counter() - t
    kept = _diffusion_gemma_answer(out, settings)
    text = tok.decode(kept) if tok is not None else None
    res = {"token_ids": kept, "text": text, "canvases": len(out) // model.canvas_length, "seconds": round(seconds, 4)}
    if model.mesh is not None:
        res["mesh"] = {ax: int(model.mesh.shape[ax]) for ax in sharding.MESH_AXES}
    if timed is not None:
        res["timed_seconds"] = round(timed, 4)
    if a.json:
        print(json.dumps(res))
    else:
        print(text if text is not None else " ".join(map(str, kept)))
        print(f"[{len(kept)} tokens in {res['canvases']} canvas(es) of {model.canvas_length}, {seconds:.2f}s incl. "
              f"compile{'' if timed is None else f'; timed rerun {timed:.3f}s'}]", file=sys.stderr)


def cmd_generate(a):
    import numpy as np
    from dinfer_jax import compile_cache, generate
    from dinfer_jax.families.diffusion_gemma import is_folder
    if a.model is not None and is_folder(model_dir := _model_dir(a)):
        return _generate_diffusion_gemma(a, model_dir)
    if getattr(a, "prompts_file", None) is not None:
        if _constraint_flags(a) is not None:
            raise ValueError("--suffix / --infill / --json-schema / --json-object / --regex / --choice work with one prompt "
                             "(--prompt / --prompt-ids), not --prompts-file")
        return _generate_prompts_file(a)
    if _constraint_flags(a) is not None:
        return _generate_constrained(a)
    compile_cache.enable(a.compile_cache)  # before the first compile
    model_dir, tok, ids, sp, model = _prompt_setup(a)
    observer = None
    if a.show_canvas and _is_main_process():
        from dinfer_jax.canvas_view import CanvasView
        cfg = model.config
        view = CanvasView(cfg.mask_token_id, {cfg.eos_token_id, cfg.eot_token_id} - {None},
                          decode=tok.decode if tok is not None else None, stream=sys.stderr)
        observer = view if view.enabled else None
    from dinfer_jax import compile_cache
    c0 = compile_cache.stats()
    r = generate(model, [np.asarray(ids)], sp, observer=observer)
    c1 = compile_cache.stats()
    compile_s, hits = c1["compile_seconds"] - c0["compile_seconds"], c1["hits"] - c0["hits"]
    timed = generate(model, [np.asarray(ids)], sp).seconds if a.timed else None  # compiled: decode time only
    if not _is_main_process():
        return
    text = tok.decode(r.token_ids[0]) if tok is not None else None
    out = {"token_ids": r.token_ids[0], "text": text, "nfe": r.nfe[0], "tpf": round(r.tpf[0], 3),
           "seconds": round(r.seconds, 4), "compile_seconds": round(compile_s, 4), "compile_cache_hits": hits,
           "compile_cache": c1["dir"]}
    if timed is not None:
        out["timed_seconds"] = round(timed, 4)
        out["tokens_per_s"] = round(len(r.token_ids[0]) / max(timed, 1e-9), 1)
    if a.json:
        print(json.dumps(out))
    else:
        print(text if text is not None else " ".join(map(str, r.token_ids[0])))
        n = len(r.token_ids[0])
        cache = (f"{hits} program(s) from the compile cache {c1['dir']}" if hits else
                 f"compile cache {c1['dir']}" if c1["dir"] else "compile cache off")
        rerun = f"; timed rerun {timed:.3f}s = {out['tokens_per_s']:.0f} tokens/s" if timed is not None else ""
        print(f"[{n} tokens, {r.nfe[0]} forwards, {r.tpf[0]:.2f} tokens/forward, {r.seconds:.2f}s incl. compile"
              f"{rerun}; XLA compile {compile_s:.2f}s; {cache}]", file=sys.stderr)


def _constraint_flags(a):
    """The generate flags' canvas template (structured.StructuredOutput | Infill) or None."""
    from dinfer_jax.structured import Infill, InfillSpans, StructuredOutput
    if getattr(a, "suffix", None) is not None:
        return Infill(suffix=a.suffix, span=a.span or 0)
    if getattr(a, "infill", None) is not None:
        try:
            pieces = json.loads(a.infill)
        except ValueError as e:
            raise ValueError(f"--infill: not JSON ({e}); e.g. '[\"0\", 1, \"6\", 1]'") from None
        return InfillSpans(tuple(pieces) if isinstance(pieces, list) else pieces)
    if getattr(a, "json_schema", None) is not None:
        src = a.json_schema
        text = open(src, encoding="utf-8").read() if os.path.isfile(src) else src
        try:
            return StructuredOutput(json=json.loads(text))
        except ValueError as e:
            raise ValueError(f"--json-schema: neither a file nor JSON text ({e})") from None
    if getattr(a, "json_object", False):
        return StructuredOutput(json_object=True)
    if getattr(a, "regex", None) is not None:
        return StructuredOutput(regex=a.regex)
    if getattr(a, "choice", None):
        return StructuredOutput(choice=list(a.choice))
    return None


def _generate_constrained(a):
    """generate with a canvas template: the answer is its render (infill span, JSON, regex, choice)."""
    import numpy as np
    from dinfer_jax import compile_cache
    from dinfer_jax.json_template import SchemaError
    from dinfer_jax.structured import Infill, generate_structured
    if a.show_canvas or a.timed:
        raise ValueError(f"{'--show-canvas' if a.show_canvas else '--timed'} does not combine with a canvas template")
    compile_cache.enable(a.compile_cache)
    model_dir, tok, ids, sp, model = _prompt_setup(a)
    if tok is None:
        raise ValueError(f"a canvas template needs {os.path.join(model_dir, 'tokenizer.json')}")
    c = _constraint_flags(a)
    if isinstance(c, Infill):
        c = Infill(suffix=c.suffix, span=a.span or sp.gen_length)
    try:
        answers, r = generate_structured(model, tok, [np.asarray(ids)], [c], sp)
    except SchemaError as e:
        raise ValueError(f"{e} (keyword: {e.keyword})") from None
    if not _is_main_process():
        return
    if a.json:
        print(json.dumps({"text": answers[0], "token_ids": r.token_ids[0], "nfe": r.nfe[0],
                          "seconds": round(r.seconds, 4)}))
    else:
        print(answers[0])
        print(f"[{r.nfe[0]} forwards, {r.seconds:.2f}s incl. compile]", file=sys.stderr)


def _read_prompts_file(path: str) -> tuple[list[tuple[int, object]], bool]:
    """-> ([(line number, prompt)], is_jsonl). JSONL when the first non-blank line parses as a JSON
    object: then every non-blank line must be {"prompt": text or [token ids], ...}. Otherwise plain
    text: each non-blank line is one prompt (its line ending removed). Blank lines are skipped."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--prompts-file {path!r} does not exist")
    with open(path, encoding="utf-8") as f:
        lines = [(n, line.rstrip("\r\n")) for n, line in enumerate(f, 1) if line.strip()]
    if not lines:
        raise ValueError(f"--prompts-file {path!r} has no prompts (it is empty)")
    try:
        jsonl = isinstance(json.loads(lines[0][1]), dict)
    except ValueError:
        jsonl = False
    if not jsonl:
        return lines, False
    out = []
    for n, line in lines:
        try:
            obj = json.loads(line)
        except ValueError as e:
            raise ValueError(f"{path} line {n}: not JSON ({e}); a file whose first line is a JSON object is read "
                             f"as JSONL, one {{\"prompt\": ...}} per line") from None
        p = obj.get("prompt") if isinstance(obj, dict) else None
        ok = isinstance(p, str) or (isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool)
                                                                       for t in p))
        if not ok:
            raise ValueError(f"{path} line {n}: expected {{\"prompt\": \"text\"}} or {{\"prompt\": [token ids]}}, "
                             f"got {line[:80]}")
        out.append((n, p))
    return out, True


def _generate_prompts_file(a):
    """generate --prompts-file: every prompt of the file, --batch-size at a time, one output line each
    (in file order) as soon as its batch is decoded."""
    import numpy as np
    from dinfer_jax import compile_cache, generate
    from dinfer_jax.tokenizer import has_tokenizer, load_tokenizer
    if a.show_canvas or a.timed:
        raise ValueError(f"{'--show-canvas' if a.show_canvas else '--timed'} works with one prompt "
                         "(--prompt / --prompt-ids), not --prompts-file")
    compile_cache.enable(a.compile_cache)
    entries, _ = _read_prompts_file(a.prompts_file)
    model_dir = _model_dir(a)
    tok = load_tokenizer(model_dir) if has_tokenizer(model_dir) else None
    rows = []
    for n, p in entries:
        where = f"{a.prompts_file} line {n}"
        if isinstance(p, list):
            rows.append(p)
        elif tok is None:
            raise ValueError(f"{where}: text prompts need {os.path.join(model_dir, 'tokenizer.json')}; give "
                             "token ids instead (JSONL {\"prompt\": [1, 2, 3]})")
        else:
            ids = tok.encode_prompt(p, where)
            if not ids:
                raise ValueError(f"{where}: the prompt is empty")
            rows.append(ids)
    sp = _sampling_params(a, model_dir)
    model = _load_model(a, model_dir)
    is_main = _is_main_process()
    t0, tokens = time.perf_counter(), 0
    for start in range(0, len(rows), a.batch_size):
        chunk = rows[start:start + a.batch_size]
        r = generate(model, [np.asarray(ids) for ids in chunk], sp)
        if not is_main:
            continue
        for i, ids in enumerate(r.token_ids):
            k = start + i
            text = tok.decode(ids) if tok is not None else None
            tokens += len(ids)
            if a.json:
                print(json.dumps({"index": k, "line": entries[k][0], "prompt": entries[k][1], "token_ids": ids,
                                  "text": text, "nfe": r.nfe[i], "tpf": round(r.tpf[i], 3)}))
            else:
                print(text.replace("\n", "\\n") if text is not None else " ".join(map(str, ids)))
        sys.stdout.flush()
    if is_main:
        n_batches = -(-len(rows) // a.batch_size)
        print(f"[{len(rows)} prompts in {n_batches} batch(es) of at most {a.batch_size}, {tokens} tokens, "
              f"{time.perf_counter() - t0:.2f}s incl. compile]", file=sys.stderr)


class _AnswerStream:
    """Writes one answer to `out` as its blocks commit: the engine's observer (fn(step, gen_BG,
    blk_B, done_B, active_B), as the server's streaming), then `finish(ids)` with the final ids."""

    def __init__(self, decode, stops, mask_id: int, block_length: int, out):
        self.decode, self.stops, self.mask_id, self.bl, self.out = decode, stops, mask_id, block_length, out
        self.blocks, self.sent = 0, ""

    def __call__(self, step, gen_BG, blk_B, done_B, active_B):
        finished = gen_BG.shape[1] // self.bl if done_B[0] else int(blk_B[0])
        if finished > self.blocks:
            self.blocks = finished
            # a trailing U+FFFD is half a character whose other bytes are in the next block
            ids, _ = ids_until_stop(gen_BG[0, :finished * self.bl], self.stops, self.mask_id)
            self._write(self.decode(ids).rstrip("\ufffd"))

    def _write(self, text: str) -> bool:
        if not text.startswith(self.sent):
            return False
        if len(text) > len(self.sent):
            self.out.write(text[len(self.sent):])
            self.out.flush()
            self.sent = text
        return True

    def finish(self, ids) -> str:
        """Write the rest of the answer (the whole answer again on a new line in the rare case a later
        block changed text already written) and a newline; -> the answer text."""
        text = self.decode(ids)
        if not self._write(text):
            self.out.write("\n" + text)
        self.out.write("\n")
        self.out.flush()
        return text


CHAT_COMMANDS = ("/reset", "/exit", "/quit")


def cmd_chat(a):
    """Interactive chat: one user message per stdin line, answers streamed to stdout block by block
    (DiffusionGemma: written whole, its canvases are not streamed)."""
    import numpy as np
    from dinfer_jax import compile_cache, generate
    from dinfer_jax.chat import ChatFormatter
    from dinfer_jax.families.diffusion_gemma import is_folder
    from dinfer_jax.tokenizer import has_tokenizer, load_tokenizer
    model_dir = _model_dir(a)
    if not has_tokenizer(model_dir):
        raise ValueError(f"chat needs {os.path.join(model_dir, 'tokenizer.json')} (text in, text out); this folder "
                         "has none: use generate --prompt-ids")
    tok = load_tokenizer(model_dir)
    if is_folder(model_dir):
        return _chat_loop(a, tok, *_diffusion_gemma_chat(a, model_dir, tok))
    compile_cache.enable(a.compile_cache)
    sp = _sampling_params(a, model_dir)
    model = _load_model(a, model_dir)
    cfg = model.config
    stops = frozenset() if sp.ignore_eos else cfg.stop_ids

    def answer(ids):
        out = _AnswerStream(tok.decode, stops, cfg.mask_token_id, sp.block_length, sys.stdout)
        r = generate(model, [np.asarray(ids)], sp, observer=None if a.no_stream else out)
        text = out.finish(ids_until_stop(r.raw_ids[0], stops, cfg.mask_token_id)[0])
        return text, f"{r.nfe[0]} forwards, {r.tpf[0]:.2f} tokens/forward, {r.seconds:.2f}s"
    banner = f"gen {sp.gen_length}, block {sp.block_length}, {sp.strategy} / {sp.cache}"
    return _chat_loop(a, tok, ChatFormatter(model_dir, cfg.family), cfg.max_position_embeddings, sp.gen_length,
                      answer, banner)


def _diffusion_gemma_chat(a, model_dir: str, tok):
    """DiffusionGemma's chat pieces for _chat_loop: the folder's own chat template (no built-in one:
    ChatTemplateError when the folder has none) and a turn decoded by families/diffusion_gemma.generate."""
    from dinfer_jax.chat import ChatFormatter
    from dinfer_jax.families import diffusion_gemma as dgf
    fmt = ChatFormatter(model_dir, "diffusion_gemma")
    settings, model = _diffusion_gemma_model(a, model_dir)
    turns = [0]

    def answer(ids):
        t = time.perf_counter()
        out = dgf.generate(model, [ids], settings, seed=(a.seed or 0) + turns[0])[0]
        turns[0] += 1
        text = tok.decode(_diffusion_gemma_answer(out, settings))
        print(text, flush=True)
        return text, f"{len(out) // model.canvas_length} canvas(es), {time.perf_counter() - t:.2f}s"
    banner = f"DiffusionGemma, max_new_tokens {settings.max_new_tokens}, canvas {model.canvas_length}"
    with open(os.path.join(model_dir, "config.json")) as f:  # the text model's positions (load read it already)
        max_positions = int(json.load(f).get("text_config", {}).get("max_position_embeddings", 2**31))
    return fmt, max_positions, settings.max_new_tokens, answer, banner


def _chat_loop(a, tok, fmt, max_positions: int, gen_length: int, answer, banner: str):
    """The chat REPL: each stdin line is a user message; the conversation (with --system) rendered by
    `fmt`, oldest exchanges dropped past max_positions, answered by answer(prompt ids) -> (text,
    stats line). A bad message is reported and the conversation goes on."""
    system = [{"role": "system", "content": a.system}] if a.system else []
    if a.system:
        tok.encode_prompt(a.system, "--system")
    history: list[dict] = []
    interactive = sys.stdin.isatty()
    print(f"dinfer-jax chat: {os.path.basename(os.path.normpath(_model_dir(a)))} ({banner}); /reset clears the "
          f"history, /exit or EOF quits", file=sys.stderr, flush=True)
    while True:
        try:
            line = input("> " if interactive else "")
        except EOFError:
            break
        cmd = line.strip()
        if not cmd:
            continue
        if cmd in ("/exit", "/quit"):
            break
        if cmd == "/reset":
            history = []
            print("[history cleared]", file=sys.stderr, flush=True)
            continue
        if cmd.startswith("/") and " " not in cmd:
            print(f"dinfer-jax: unknown command {cmd} (commands: {', '.join(CHAT_COMMANDS)}); not sent",
                  file=sys.stderr, flush=True)
            continue
        user = {"role": "user", "content": line}
        try:
            tok.encode_prompt(line, "your message")  # no special tokens written as text, no unknown characters
            while True:
                text = fmt(system + history + [user])
                ids = tok.encode_prompt(text, "the chat prompt", allow_special=True)
                if len(ids) + gen_length <= max_positions or not history:
                    break
                history = history[2:]  # the oldest exchange
                print("[the oldest exchange was dropped: the conversation exceeds the model's "
                      f"{max_positions} positions]", file=sys.stderr, flush=True)
            if a.show_prompt:
                print(f"[prompt: {len(ids)} tokens]\n{text}\n[/prompt]", file=sys.stderr, flush=True)
            reply, stats = answer(ids)
        except ValueError as e:  # this message only: the conversation goes on
            print(f"dinfer-jax: error: {_message(e)}", file=sys.stderr, flush=True)
            continue
        history += [user, {"role": "assistant", "content": reply}]
        if interactive:
            print(f"[{stats}]", file=sys.stderr)


def cmd_eval(a):
    from dinfer_jax import evaluate as ev
    from dinfer_jax import load_model
    from dinfer_jax.tokenizer import has_tokenizer, load_tokenizer
    model_dir = _model_dir(a)
    if a.suite == "jsonl" and not a.data:
        raise ValueError("the jsonl suite needs --data FILE (one {\"prompt\": ..., \"answer\": ...} per line)")
    if a.data and not os.path.isfile(a.data):
        raise FileNotFoundError(f"--data {a.data!r} does not exist")
    if a.suite == "jsonl":
        ev.read_jsonl(a.data)  # report a malformed file before loading the model
    many = a.suite == "demo"
    # Without --strategy / --cache, jsonl and humaneval decode with the model's defaults (None);
    # 'all' caches are those the model can decode with (its config decides: block only if block-causal).
    from dinfer_jax.families import load_hf_config
    strategies = ev.parse_strategies(a.strategy or "all") if a.strategy or many else [None]
    caches = ev.parse_caches(a.cache or "all", load_hf_config(model_dir)) if a.cache or many else [None]
    from dinfer_jax.checkpoint import generation_defaults
    lengths = {k: getattr(a, k) for k in ("gen_length", "block_length") if getattr(a, k) is not None}
    defaults = _model_defaults(model_dir, **lengths).validate()
    gen_length, block_length = defaults.gen_length, defaults.block_length
    model = load_model(model_dir)
    tok = load_tokenizer(model_dir) if has_tokenizer(model_dir) else None
    _warn_off_defaults(generation_defaults(model_dir), model_dir, gen_length=gen_length, block_length=block_length)
    overrides = dict(threshold=a.threshold, low_threshold=a.low_threshold, factor=a.factor)
    if a.out:
        os.makedirs(a.out, exist_ok=True)
    say = (lambda *x: None) if a.json else (lambda *x: print(*x, file=sys.stderr, flush=True))

    def progress(r):
        say(f"  {r['strategy']:>9} / {r['cache']:<8} exact match {100 * r['accuracy']:5.1f}%  NFE {r['nfe']:.2f}  "
            f"TPF {r['tpf']:.2f}  {r['tokens_per_s']:.0f} tok/s  (compile {r['compile_seconds']:.1f}s)")

    result = {"suite": a.suite, "model": os.path.abspath(model_dir)}
    if a.suite == "humaneval":
        if len(strategies) != 1 or len(caches) != 1:
            raise ValueError("the humaneval suite runs one --strategy and one --cache")
        if a.model is None:
            say("note: the built-in demo model was trained on toy tasks only; HumanEval with it exercises "
                "the pipeline (pass@1 ~ 0), pass --model for a real checkpoint")
        sp = ev.sampling_params(strategies[0], caches[0], gen_length, block_length, model=model, **overrides)
        summary, records = ev.eval_humaneval(model, tok, sp, limit=a.limit, batch_size=a.batch_size)
        result.update(summary)
        text = (f"HumanEval pass@1 {100 * summary['pass@1']:.1f}% on {summary['n']} problems "
                f"(NFE {summary['nfe']:.1f}, TPF {summary['tpf']:.2f}, {summary['truncated_prompts']} prompts truncated)")
        preds = records
    else:
        if a.suite == "demo":
            preds = None
            result.update(n=a.n, seed=a.seed)
            # without --model: both built-in demo models (LLaDA-MoE, and the LLaDA2 block-diffusion one)
            from dinfer_jax.checkpoint import DEMO_BLOCK_MODEL_DIR, is_checkpoint
            runs = [(model_dir, model, tok, gen_length, block_length)]
            if a.model is None and is_checkpoint(DEMO_BLOCK_MODEL_DIR):
                d = generation_defaults(DEMO_BLOCK_MODEL_DIR)
                runs.append((DEMO_BLOCK_MODEL_DIR, load_model(DEMO_BLOCK_MODEL_DIR), load_tokenizer(DEMO_BLOCK_MODEL_DIR),
                             a.gen_length or d.get("gen_length", 16), d["block_length"]))
            rows, sections = [], []
            for path, m, t, gl, bl in runs:
                name = os.path.basename(os.path.normpath(path))
                if m.config.attention_mask == "block_causal":
                    say(f"{name}: demo tasks, {a.n} fresh problems (seed {a.seed}), gen {gl} block {bl}, "
                        f"block diffusion ({len(ev.BLOCK_SETTINGS)} decoders)")
                    part = ev.eval_demo_block(m, t, n=a.n, seed=a.seed, gen_length=gl, block_length=bl,
                                              batch_size=a.batch_size, progress=progress)
                else:
                    say(f"{name}: demo tasks, {a.n} fresh problems (seed {a.seed}), gen {gl} block {bl}, "
                        f"{len(strategies)} strategies x {len(caches)} caches")
                    part = ev.eval_demo(m, t, n=a.n, seed=a.seed, strategies=strategies, caches=caches,
                                        gen_length=gl, block_length=bl, batch_size=a.batch_size,
                                        overrides=overrides, progress=progress)
                for r in part:
                    r["model"] = name
                rows += part
                sections.append((name, part))
            result["rows"] = rows
            text = "\n\n".join(f"## {name}\n\n{ev.format_table(part)}" if len(sections) > 1 else ev.format_table(part)
                                for name, part in sections)
            if a.out:
                with open(os.path.join(a.out, "table.md"), "w") as f:
                    f.write(text + "\n")
                for i, (name, part) in enumerate(sections):
                    png = os.path.join(a.out, "accuracy_vs_tpf.png" if i == 0 else f"accuracy_vs_tpf_{name}.png")
                    if ev.plot_accuracy_vs_tpf(part, png, title=f"{name}: exact match vs tokens per forward"):
                        result.setdefault("plots", []).append(png)
        else:
            rows, preds = ev.eval_jsonl(model, tok, a.data, strategies=strategies, caches=caches,
                                        gen_length=gen_length, block_length=block_length,
                                        batch_size=a.batch_size, overrides=overrides, progress=progress)
            result.update(data=os.path.abspath(a.data))
            result["rows"] = rows
            text = ev.format_table(rows)
        if a.out and a.suite != "demo":
            with open(os.path.join(a.out, "table.md"), "w") as f:
                f.write(text + "\n")
            if ev.plot_accuracy_vs_tpf(rows, os.path.join(a.out, "accuracy_vs_tpf.png"),
                                       title=f"{a.suite}: exact match vs tokens per forward"):
                result["plot"] = os.path.join(a.out, "accuracy_vs_tpf.png")
    if a.out:
        with open(os.path.join(a.out, "results.json"), "w") as f:
            json.dump(result, f, indent=1)
        if preds:
            with open(os.path.join(a.out, "predictions.jsonl"), "w") as f:
                f.writelines(json.dumps(p) + "\n" for p in preds)
    if a.json:
        print(json.dumps(result))
    else:
        print(text)


def cmd_lm_eval(a):
    try:
        from dinfer_jax.lm_eval_adapter import main as lm_eval_main
    except ImportError as e:
        raise ValueError(str(e)) from None
    lm_eval_main(a.lm_eval_argv)


def cmd_train(a):
    from dinfer_jax import train
    train.main(a.train_argv)


def cmd_demo(a):
    """Tiny random LLaDA-MoE: save -> export as HF safetensors -> convert back -> forward; the logits
    of the reloaded model must equal the original's bit for bit. Without --workdir the files go to a
    temporary folder, removed afterwards."""
    if a.workdir:
        return _demo_round_trip(a.workdir)
    with tempfile.TemporaryDirectory(prefix="dinfer-jax-demo-") as work:
        _demo_round_trip(work, " (a temporary folder, removed now)")


def _demo_round_trip(work: str, note: str = ""):
    import jax
    import numpy as np
    from converters import convert, export
    from dinfer_jax import checkpoint as ckpt
    from dinfer_jax.families import preset, to_hf_dict
    from dinfer_jax.model import Model
    from dinfer_jax.models import init_params

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
    print(f"HF export + convert round trip in {work}{note}: logits identical = {same}")
    print(f"argmax per position: {b_logits.argmax(-1).tolist()}")
    if not same:
        raise SystemExit("demo failed: logits differ after the round trip")


def _int_list(text):
    try:
        vals = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not vals or min(vals) <= 0:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return vals


def _add_decoding_flags(p, with_lengths: bool = True):
    """The decoding settings, one flag per field that decoding/spec.SETTINGS marks `cli` (its help,
    choices and kind), plus --edit-mode. Unset flags take the model's defaults (SamplingParams.for_model:
    its family's, then its folder's generation_config.json; `dinfer-jax info DIR` prints them)."""
    groups = {GENERAL: p}
    for name in _DECODING_FLAGS:
        s = SETTINGS[name]
        if name in ("gen_length", "block_length") and not with_lengths:
            continue
        if s.group not in groups:
            groups[s.group] = p.add_argument_group(GROUP_TITLES[s.group])
            if s.group == BLOCK_GROUP:
                groups[s.group].add_argument(
                    "--edit-mode", choices=tuple(EDIT_MODES), default=None,
                    help="LLaDA2.1 preset: quality = threshold 0.7, editing 0.5; speed = threshold 0.5, editing 0.0 "
                         "(max-post-steps 16); explicit flags override it")
        if s.kind == BOOL:
            kw = dict(action="store_true")
        elif s.kind == CHOICE:
            kw = dict(choices=s.choices, default=None)
        elif s.kind == INT:
            kw = dict(type=_positive if s.low == 1 else int, default=None)
        else:
            kw = dict(type=float, default=None)
        groups[s.group].add_argument(flag_name(name), help=s.help, **kw)


def _add_scale_flags(p):
    g = p.add_argument_group("scale (device mesh, multi-host)")
    g.add_argument("--mesh", default=None, help='device mesh, e.g. "data=2,expert=4" or "expert=4,model=2" '
                                                '(axes data, expert, model; -1 = the remaining devices)')
    g.add_argument("--coordinator", default=None, help="multi-host: coordinator host:port (env DINFER_COORDINATOR)")
    g.add_argument("--num-processes", type=_positive, default=None, help="multi-host: processes (env DINFER_NUM_PROCESSES)")
    g.add_argument("--process-id", type=int, default=None, help="multi-host: this process (env DINFER_PROCESS_ID)")


def _serve_defaults(a, model_dir: str):
    """ServerConfig.default_params: the model's defaults (SamplingParams.for_model) with the serve
    command's explicit flags over them; --default-max-tokens is their gen_length."""
    flags = _explicit_flags(a)
    if a.default_max_tokens is not None:
        flags["gen_length"] = a.default_max_tokens
    return _model_defaults(model_dir, **flags)


def cmd_serve(a):
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        raise ValueError("serve needs FastAPI and uvicorn: pip install 'dinfer-jax[serve]'") from None
    from dinfer_jax import compile_cache
    from dinfer_jax.serving.scheduler import ServerConfig
    from dinfer_jax.serving.http import serve
    model_dir = _model_dir(a)
    defaults = _serve_defaults(a, model_dir)
    if a.steps is not None and a.steps > a.max_steps:
        raise ValueError(f"--steps {a.steps} exceeds --max-steps {a.max_steps}")
    if defaults.max_post_steps > a.max_post_steps_limit:
        raise ValueError(f"--max-post-steps {defaults.max_post_steps} exceeds --max-post-steps-limit "
                         f"{a.max_post_steps_limit}")
    name = a.model_name or os.path.basename(os.path.normpath(model_dir))
    cfg = ServerConfig(model_name=name, default_params=defaults,
                       default_max_tokens=defaults.gen_length, max_tokens=a.max_tokens,
                       max_batch=a.max_batch, max_queue=a.max_queue, batch_wait_s=a.batch_wait_ms / 1000,
                       max_steps=a.max_steps, max_post_steps=a.max_post_steps_limit,
                       request_timeout_s=a.request_timeout or None, warmup=a.warmup, scheduler=a.scheduler,
                       segment=a.segment, repack=not a.no_repack, prefix_cache_mb=a.prefix_cache_mb,
                       warmup_max_tokens=a.warmup_max_tokens or (), warmup_prompt_len=a.warmup_prompt_len,
                       max_body_bytes=int(a.max_body_mb * 2 ** 20), max_prompt_chars=a.max_prompt_chars,
                       watchdog_s=a.watchdog, compile_watchdog_s=a.compile_watchdog, drain_timeout_s=a.drain_timeout,
                       max_model_len=a.max_model_len)
    if cfg.default_max_tokens > cfg.max_tokens:
        raise ValueError(f"--default-max-tokens {cfg.default_max_tokens} exceeds --max-tokens {cfg.max_tokens}")
    compile_cache.enable(a.compile_cache)  # before the first compile (load_model places params)
    model = _load_model(a, model_dir)
    print(f"serving {name!r} on http://{a.host}:{a.port}/v1 (max batch {a.max_batch}, {a.scheduler} scheduler"
          f"{'; compiling the default settings first (--warmup)' if a.warmup else ''})", file=sys.stderr, flush=True)
    serve(model_dir, a.host, a.port, cfg, model=model, log_level=a.log_level)


def cmd_bench(a):
    from dinfer_jax.benchmark import format_table, run_bench
    bad = [s for s in a.strategies.split(",") if s not in STRATEGIES] + [c for c in a.caches.split(",") if c not in CACHES]
    if bad:
        raise ValueError(f"unknown strategy/cache {bad}; strategies {STRATEGIES}, caches {CACHES}")
    model_dir = _model_dir(a)
    base = _sampling_params(a, model_dir)
    model = _load_model(a, model_dir)
    rows = run_bench(model, a.batch, a.strategies.split(","), a.caches.split(","), a.prompt_len, base, a.repeats,
                     progress=not a.json and _is_main_process())
    if not _is_main_process():
        return
    if a.json:
        import dataclasses
        print(json.dumps([dataclasses.asdict(r) for r in rows]))
    else:
        print(f"{model_dir}: prompt {a.prompt_len} tokens, gen {base.gen_length}, block {base.block_length}, "
              f"median of {a.repeats}")
        print(format_table(rows))


def _check_writable_dir(path: str, what: str):
    """Create `path` if needed; OSError naming `what` when it cannot be written (before long work)."""
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as e:
        raise OSError(e.errno, f"{what} {path!r} is not writable ({e.strerror or e})") from None


def cmd_profile(a):
    import numpy as np
    from dinfer_jax.profiling import profile_generation
    _check_writable_dir(a.logdir, "--logdir")  # before the model loads and compiles
    model_dir, tok, ids, sp, model = _prompt_setup(a)
    out = profile_generation(model, [np.asarray(ids)], sp, a.logdir, a.repeats)
    if _is_main_process():
        r = out["result"]
        print(f"traced {a.repeats} generation(s) ({r.nfe[0]} forwards, {r.seconds:.3f}s each) into {a.logdir}")
        for f in out["trace_files"]:
            print(f"  {f}")
        print(f"view it with: tensorboard --logdir {a.logdir} --host 127.0.0.1 --port 6006   "
              f"(pip install tensorboard xprof; docs/profiling.md)")
        print(f"top ops by self time: python bench/profile_top_ops.py {a.logdir}   (from a checkout)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="dinfer-jax", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Inference for masked-diffusion language models in JAX (LLaDA, LLaDA-MoE, LLaDA2.x,\n"
                    "Dream/DiffuCoder, SDAR, Fast-dLLM v2): the whole denoising schedule runs as one compiled loop.",
        epilog="""examples:
  dinfer-jax generate --prompt "add 123+045="               # the built-in demo model -> 0168
  dinfer-jax generate --model demo-block --prompt "sort 5391="   # the block-diffusion demo model -> 1359
  dinfer-jax convert ~/hf/LLaDA-MoE-7B-A1B-Instruct ckpt/   # Hugging Face folder -> checkpoint
  dinfer-jax generate --model ckpt/ --prompt "Hi" --gen-length 128 --block-length 64 --threshold 0.9
  dinfer-jax generate --model ckpt/ --prompt-ids 1,2,3 --show-canvas      # watch the masks resolve
  dinfer-jax chat --model ckpt/                             # interactive, answers streamed
  dinfer-jax serve --model ckpt/ --port 8000                # OpenAI-compatible server
  dinfer-jax bench --model ckpt/ --batch 1,4,16 --strategies threshold,credit
  dinfer-jax profile --model ckpt/ --prompt "Hi" --logdir /tmp/prof    # docs/profiling.md: viewing, top ops
  dinfer-jax eval demo                                      # accuracy / tokens per forward table
  dinfer-jax plan --preset llada2-mini --topology v5e:2x2 --mesh expert=4   # compile for TPU, no TPU needed

'dinfer-jax COMMAND --help' lists a command's options.""")
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("convert", help="HF folder (safetensors / .bin, sharded or not, dInfer fused) -> "
                                       "dinfer-jax checkpoint")
    c.add_argument("src")
    c.add_argument("dst")
    c.add_argument("--dtype", choices=DTYPES, default=None, help="cast params (default: keep the checkpoint's)")
    c.add_argument("--quantize", default=None, metavar="int8|fp8",
                   help="store the attention, MLP / expert and LM-head weights as int8 (per output channel) or "
                        "fp8 e4m3 (128x128 block scales); dequantized inside the matmuls")
    c.add_argument("--quiet", action="store_true")
    c.add_argument("--overwrite", action="store_true", help="replace a non-empty DST_DIR whole")
    c.set_defaults(fn=cmd_convert)
    e = sub.add_parser("export", help="dinfer-jax checkpoint -> HF safetensors folder")
    e.add_argument("src", help="a dinfer-jax checkpoint folder, or 'demo' / 'demo-block' (the built-in demo models)")
    e.add_argument("dst")
    e.add_argument("--quiet", action="store_true")
    e.add_argument("--overwrite", action="store_true", help="replace a non-empty HF_DIR whole")
    e.add_argument("--max-shard-size", type=_shard_size, default="5GB", metavar="SIZE",
                   help="largest safetensors shard, as transformers' save_pretrained: bytes or 500MB / 5GB / "
                        "2GiB (default 5GB); one model.safetensors when everything fits, else "
                        "model-0000i-of-0000N.safetensors + model.safetensors.index.json")
    e.set_defaults(fn=cmd_export)
    i = sub.add_parser("info", help="print the config of a model folder")
    i.add_argument("model", help="a model folder, or 'demo' / 'demo-block' (the built-in demo models)")
    i.set_defaults(fn=cmd_info)
    lg = sub.add_parser("logits", help="one full bidirectional forward; prints the argmax per position")
    lg.add_argument("--model", required=True, help="a model folder, or 'demo' / 'demo-block' (the built-in demo "
                                                   "models)")
    lg.add_argument("--prompt-ids", type=_parse_ids, required=True)
    lg.add_argument("--json", action="store_true")
    _add_scale_flags(lg)
    lg.set_defaults(fn=cmd_logits)
    g = sub.add_parser("generate", help="diffusion decoding of one prompt, or of a file of prompts in batches (the "
                                        "whole schedule in one jitted loop)")
    _add_model_and_prompt_flags(g).add_argument(
        "--prompts-file", default=None, metavar="FILE",
        help="many prompts, one output line each, in order: JSONL when the first non-blank line is a JSON object "
             "(then every line is {\"prompt\": \"text\"} or {\"prompt\": [token ids]}), else plain text with one "
             "prompt per line; blank lines are skipped. A newline inside an answer is printed as \\n (--json keeps "
             "the exact text, with index, line, prompt, token_ids, text, nfe, tpf)")
    g.add_argument("--batch-size", type=_positive, default=16,
                   help="--prompts-file: prompts decoded together in one generate call (default 16)")
    _add_decoding_flags(g)
    g.add_argument("--show-canvas", action="store_true",
                   help="redraw the canvas after every step on the terminal (masked positions as '░'; off when "
                        "stderr is not a terminal)")
    g.add_argument("--json", action="store_true", help="print one JSON object: token_ids, text, nfe, tpf, seconds, "
                                                       "compile_seconds, compile_cache_hits, compile_cache")
    g.add_argument("--timed", action="store_true",
                   help="decode a second time with the compiled program and report its seconds and tokens/s")
    con = g.add_mutually_exclusive_group()  # canvas templates (dinfer_jax/structured.py); one prompt
    con.add_argument("--suffix", default=None, metavar="TEXT",
                     help="infill: --span positions between the prompt and this text; prints the filled span")
    con.add_argument("--infill", default=None, metavar="JSON",
                     help='the generation region as a JSON list of text (kept) and span lengths (filled), e.g. '
                          '\'["0", 1, "6", 1]\'; prints the whole region')
    con.add_argument("--json-schema", default=None, metavar="FILE_OR_JSON",
                     help="the answer is JSON valid under this schema (a file, or the schema's JSON text)")
    con.add_argument("--json-object", action="store_true", help="the answer is a JSON object")
    con.add_argument("--regex", default=None, help="the answer matches this pattern (the supported subset: docs/"
                                                   "structured_output.md)")
    con.add_argument("--choice", default=None, action="append", help="the answer is one of these (repeat the flag)")
    g.add_argument("--span", type=_positive, default=None,
                   help="--suffix: the positions to fill (default: the generation length)")
    _add_compile_cache_flag(g)
    _add_scale_flags(g)
    g.set_defaults(fn=cmd_generate)
    ch = sub.add_parser("chat", help="interactive chat with the model folder's chat template: one message per "
                                     "stdin line, answers streamed as blocks commit; /reset clears the history, "
                                     "/exit or EOF quits")
    ch.add_argument("--model", default=None, help="dinfer-jax checkpoint, HF folder or Hub id ORG/NAME (default: "
                                                  "the built-in demo model); needs tokenizer.json")
    ch.add_argument("--system", default=None, help="a system message before the conversation (kept by /reset)")
    ch.add_argument("--no-stream", action="store_true", help="print each answer when it is complete")
    ch.add_argument("--show-prompt", action="store_true",
                    help="print each turn's prompt (the chat template applied to the history) on stderr")
    _add_decoding_flags(ch)
    _add_compile_cache_flag(ch)
    ch.set_defaults(fn=cmd_chat)
    sv = sub.add_parser("serve", help="OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, "
                                      "/v1/models, /health, /stats)")
    sv.add_argument("--model", default=None, help=MODEL_HELP)
    sv.add_argument("--host", default="127.0.0.1")
    sv.add_argument("--port", type=_port, default=8000, help="1..65535 (default 8000)")
    sv.add_argument("--model-name", default=None, help="the id clients pass as `model` (default: the folder name)")
    sv.add_argument("--max-batch", type=_positive, default=16, help="requests decoded together at most")
    sv.add_argument("--max-queue", type=_positive, default=256,
                    help="waiting prompts before answering 503 (a request with more prompts gets 400)")
    sv.add_argument("--max-tokens", type=_positive, default=1024, help="largest max_tokens a request may ask")
    sv.add_argument("--max-steps", type=_positive, default=1024, help="largest steps a request may ask")
    sv.add_argument("--max-post-steps-limit", type=int, default=64, dest="max_post_steps_limit",
                    help="largest max_post_steps a request may ask (block diffusion with editing)")
    sv.add_argument("--request-timeout", type=_nonneg_float, default=600.0,
                    help="seconds before a request is answered 504 and dropped if not yet decoding (0: none)")
    sv.add_argument("--warmup", action="store_true",
                    help="compile the default settings for every batch bucket up to --max-batch (prompts up to "
                         "32 tokens, streaming and not) before admitting traffic; /health is 503 until then")
    sv.add_argument("--default-max-tokens", type=_positive, default=None,
                    help="max_tokens when a request omits it (default: the folder's gen_length, else 128)")
    sv.add_argument("--warmup-max-tokens", type=_positive_list, default=None,
                    help="--warmup compiles the programs of these max_tokens values, e.g. 16,64,256 (default: "
                         "--default-max-tokens); other lengths compile in the background on first use")
    sv.add_argument("--warmup-prompt-len", type=_positive, default=32,
                    help="--warmup compiles every prompt-length bucket up to this many tokens (default 32)")
    sv.add_argument("--max-model-len", type=_positive, default=None,
                    help="prompt + max_tokens at most (default: the model's max_position_embeddings)")
    sv.add_argument("--max-body-mb", type=_nonneg_float, default=8.0,
                    help="request bodies above this many MiB get 413 before they are read (default 8)")
    sv.add_argument("--max-prompt-chars", type=_positive, default=None,
                    help="prompts longer than this many characters get 400 before tokenizing (default: 16 x the "
                         "maximum length)")
    sv.add_argument("--watchdog", type=_nonneg_float, default=300.0,
                    help="seconds a batch / segment may run before its requests get 504 and /health reports the "
                         "scheduler stuck (default 300)")
    sv.add_argument("--compile-watchdog", type=_nonneg_float, default=900.0,
                    help="seconds a background compile may run before the requests waiting on it get 504")
    sv.add_argument("--drain-timeout", type=_nonneg_float, default=60.0,
                    help="SIGTERM: seconds in-flight requests get to finish while new ones get 503 (default 60)")
    sv.add_argument("--batch-wait-ms", type=_nonneg_float, default=5.0, help="static scheduler: wait for more "
                    "requests before a batch")
    sv.add_argument("--scheduler", choices=("continuous", "static"), default="continuous",
                    help="continuous: finished rows leave and waiting requests join between loop segments "
                         "(default); static: each batch runs to its end")
    sv.add_argument("--segment", type=_positive, default=8,
                    help="continuous scheduler: loop iterations per segment at most (a segment also ends when a "
                         "row finishes)")
    sv.add_argument("--no-repack", action="store_true",
                    help="continuous scheduler: keep rows in the batch they started in (by default a draining "
                         "program's rows move into a smaller batch)")
    sv.add_argument("--prefix-cache-mb", type=_nonneg_float, default=256.0,
                    help="continuous scheduler, block-causal models (LLaDA2.x, SDAR): MiB of device memory for the "
                         "K/V of prompt blocks shared between requests, least recently used out first (0: off)")
    _add_decoding_flags(sv, with_lengths=False)
    sv.add_argument("--block-length", type=_positive, default=None, help="default block length (requests may override)")
    _add_compile_cache_flag(sv)
    sv.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
    _add_scale_flags(sv)
    sv.set_defaults(fn=cmd_serve)
    bn = sub.add_parser("bench", help="generation throughput: tokens/s, forwards, tokens/forward for each "
                                      "batch size x strategy x cache")
    bn.add_argument("--model", default=None, help=MODEL_HELP)
    bn.add_argument("--batch", type=_int_list, default=[1], help="comma-separated batch sizes (default 1)")
    bn.add_argument("--strategies", default="threshold", help="comma-separated strategies (default threshold)")
    bn.add_argument("--caches", default="dual", help="comma-separated caches (default dual)")
    bn.add_argument("--prompt-len", type=_positive, default=32, help="random prompt length in tokens")
    bn.add_argument("--repeats", type=_positive, default=3, help="timed runs per setting (median reported)")
    _add_decoding_flags(bn)
    bn.add_argument("--json", action="store_true", help="print the rows as JSON")
    _add_scale_flags(bn)
    bn.set_defaults(fn=cmd_bench)
    pf = sub.add_parser("profile", help="XProf trace of a generation (view: tensorboard --logdir DIR --host "
                                          "127.0.0.1 with xprof installed; docs/profiling.md)")
    _add_model_and_prompt_flags(pf)
    pf.add_argument("--logdir", required=True, help="where the trace goes (plugins/profile/<run>/*.xplane.pb)")
    pf.add_argument("--repeats", type=_positive, default=1, help="traced generations (after one untraced warm-up)")
    _add_decoding_flags(pf)
    _add_scale_flags(pf)
    pf.set_defaults(fn=cmd_profile)
    ev = sub.add_parser("eval", help="evaluate: demo tasks (strategy x cache table + plot), a JSONL file, HumanEval")
    ev.add_argument("suite", choices=("demo", "jsonl", "humaneval"))
    ev.add_argument("--model", default=None, help="dinfer-jax checkpoint or HF folder, or 'demo' / 'demo-block' "
                    "(default: the built-in demo model; the demo suite then also runs the built-in block-diffusion "
                    "demo model)")
    ev.add_argument("--data", default=None, help="jsonl suite: a file of {\"prompt\": ..., \"answer\": ...} lines")
    ev.add_argument("--n", type=_positive, default=100, help="demo suite: fresh problems")
    ev.add_argument("--seed", type=int, default=12345, help="demo suite: problem seed")
    ev.add_argument("--limit", type=_positive, default=None, help="humaneval: first N problems")
    ev.add_argument("--strategy", default=None, help="comma-separated strategies or 'all' "
                                                    "(default: all for demo, threshold otherwise)")
    ev.add_argument("--cache", default=None, help="comma-separated caches or 'all' (default: all for demo, dual otherwise)")
    ev.add_argument("--gen-length", type=_positive, default=None)
    ev.add_argument("--block-length", type=_positive, default=None)
    ev.add_argument("--threshold", type=float, default=None, help="override tau of the threshold-family strategies")
    ev.add_argument("--low-threshold", type=float, default=None)
    ev.add_argument("--factor", type=float, default=None)
    ev.add_argument("--batch-size", type=_positive, default=32)
    ev.add_argument("--out", default=None, help="write results.json, table.md, accuracy_vs_tpf.png, predictions.jsonl")
    ev.add_argument("--json", action="store_true", help="print the results as one JSON object")
    ev.set_defaults(fn=cmd_eval)
    tr = sub.add_parser("train", help="train the demo model (same options as python -m dinfer_jax.train)",
                        add_help=False)
    tr.add_argument("train_argv", nargs=argparse.REMAINDER)
    tr.set_defaults(fn=cmd_train)
    le = sub.add_parser("lm-eval", help="lm-evaluation-harness with the dinfer_jax backend registered "
                                        "(arguments go to lm_eval, e.g. run --model dinfer_jax --tasks ...)",
                        add_help=False)
    le.add_argument("lm_eval_argv", nargs=argparse.REMAINDER)
    le.set_defaults(fn=cmd_lm_eval)
    pl = sub.add_parser("plan", help="compile for a TPU topology on this host (libtpu compile-only): per-chip "
                                     "memory and fit, Mosaic calls, collectives, a predicted floor")
    src = pl.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="model folder, or 'demo' / 'demo-block' (only its config.json is read)")
    src.add_argument("--preset", help="a config preset (dinfer_jax.families.presets), e.g. llada-moe-7b-a1b")
    pl.add_argument("--topology", required=True, help="e.g. v5e:1x1, v5e:2x2, v6e:2x4, v5p:2x2x1, v7x:2x2x1")
    pl.add_argument("--mesh", default=None, help="data=,expert=,model= sizes (default: of the meshes that "
                                                 "divide the model, the best predicted floor that fits)")
    pl.add_argument("--every-mesh", action="store_true", help="without --mesh: compile every mesh (default: "
                    "best floor first, stopping at the first that fits; same choice, fewer compiles)")
    pl.add_argument("--batch", type=_positive, default=1)
    pl.add_argument("--prompt-len", type=_positive, default=256)
    pl.add_argument("--gen-length", type=_positive, default=None, help="default: the family's")
    pl.add_argument("--block-length", type=_positive, default=None, help="default: the family's")
    pl.add_argument("--cache", default=None, choices=["none", "prefix", "dual", "vicinity", "block"])
    pl.add_argument("--quantize", default=None, choices=["int8", "fp8"])
    pl.add_argument("--programs", default="generate", choices=["generate", "serving"])
    pl.add_argument("--tpf", type=float, default=1.0, help="tokens per forward for the predicted tokens/s")
    pl.add_argument("--no-find-batch", action="store_true", help="skip the second compile that finds the "
                                                                  "largest batch that fits")
    pl.add_argument("--json", action="store_true", help="print one JSON object")
    pl.set_defaults(fn=cmd_plan)
    d = sub.add_parser("demo", help="tiny random LLaDA-MoE: export, convert back, forward, compare")
    d.add_argument("--workdir", default=None)
    d.set_defaults(fn=cmd_demo)
    return p


def _message(e: Exception) -> str:
    """One line for the user: a bad setting names its flag; an OSError its file."""
    if isinstance(e, InvalidParam):
        return f"{flag_name(e.field)}: {e}"
    if isinstance(e, OSError) and e.strerror:
        return f"{e.filename}: {e.strerror}" if e.filename else e.strerror
    return " ".join(str(e).split())


def _show_warning(message, category, filename, lineno, file=None, line=None, _plain=warnings.showwarning):
    """engine.FamilyWarning (a setting that contradicts the model family) as one
    `dinfer-jax: warning:` line; other warnings as Python prints them."""
    if category.__module__ == "dinfer_jax.engine" and category.__name__ == "FamilyWarning":
        print(f"dinfer-jax: warning: {message}", file=sys.stderr)
    else:
        _plain(message, category, filename, lineno, file, line)


# Commands that hand all their arguments to another parser (argparse's REMAINDER drops a leading
# option such as --help or --steps): command -> the attribute that receives them.
PASSTHROUGH = {"train": "train_argv", "lm-eval": "lm_eval_argv"}


def main(argv=None):
    args = None
    warnings.showwarning = _show_warning
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        parser = build_parser()
        if argv[:1] and argv[0] in PASSTHROUGH:  # their own parsers read every argument, --help too
            args = parser.parse_args(argv[:1])
            setattr(args, PASSTHROUGH[argv[0]], argv[1:])
        else:
            args = parser.parse_args(argv)
        if isinstance(getattr(args, "model", None), str):  # every command's --model (info's MODEL_DIR)
            from dinfer_jax.hub import resolve_model
            args.model = resolve_model(args.model)
        args.fn(args)
    except (ValueError, OSError) as e:  # ConfigError, ConversionError, InvalidParam are ValueErrors
        print(f"dinfer-jax: error: {_message(e)}", file=sys.stderr)
        raise SystemExit(2) from None
    except KeyboardInterrupt:  # the command's own cleanup (finally blocks) has run by now
        print(f"dinfer-jax: interrupted{f' ({args.cmd})' if args else ''}", file=sys.stderr)
        sys.stdout.flush(), sys.stderr.flush()
        os._exit(130)  # not SystemExit: interpreter shutdown would print from the threads jax/orbax left


if __name__ == "__main__":
    main()

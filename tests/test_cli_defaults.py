"""Every `dinfer-jax` command with its documented defaults on the built-in demo models (`demo`,
`demo-block`), at the smallest sizes: in-process `cli.main` calls sharing one Model per folder, so
commands with equal settings share compiled programs."""
from __future__ import annotations

import configparser
import contextlib
import importlib.util
import io
import json
import os
import tempfile

from dinfer_jax import cli
from dinfer_jax import evaluate as ev
from dinfer_jax.checkpoint import DEMO_BLOCK_MODEL_DIR, DEMO_MODEL_DIR

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# family -> the name the descriptions (setup.cfg, `dinfer-jax --help`) give it
FAMILY_NAMES = {"llada": "LLaDA", "llada_moe": "LLaDA-MoE", "llada2": "LLaDA2.x", "dream": "Dream/DiffuCoder",
                "sdar": "SDAR", "fast_dllm_v2": "Fast-dLLM v2"}


def run(*argv) -> tuple[int, str, str]:
    """cli.main(argv) -> (exit code, stdout, stderr)."""
    out, err, code = io.StringIO(), io.StringIO(), 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            cli.main(list(argv))
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    return code, out.getvalue(), err.getvalue()


def ok(*argv) -> str:
    code, out, err = run(*argv)
    assert code == 0, (argv, err)
    assert "warning" not in err, (argv, err)  # the defaults are the models' own: no off-default warning
    return out


def test_every_command_with_its_defaults(tmp_path, monkeypatch):
    from dinfer_jax import families
    models, real_load = {}, cli._load_model
    monkeypatch.setattr(cli, "_load_model", lambda a, d: models.setdefault(d, real_load(a, d)))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    os.makedirs(tmp_path / "tmp")

    # descriptions name every supported family
    assert set(FAMILY_NAMES) == {f.name for f in families.all_families()}
    top = ok("--help")
    cfg = configparser.ConfigParser()
    cfg.read(os.path.join(ROOT, "setup.cfg"))
    for name in FAMILY_NAMES.values():
        assert name in " ".join(top.split()) and name in cfg["metadata"]["description"], name
    # every command's --help, the pass-through ones (their own parsers) included
    for cmd in ("convert", "export", "info", "logits", "generate", "serve", "bench", "profile", "eval", "plan",
                "demo", "train", "lm-eval"):
        if cmd == "lm-eval" and importlib.util.find_spec("lm_eval") is None:
            continue  # an optional extra (dinfer-jax[eval]); without it lm-eval says so and exits 2
        assert "usage" in ok(cmd, "--help").lower(), cmd

    # info: the folder behind each alias and its decoding defaults
    for alias, folder, cache in (("demo", DEMO_MODEL_DIR, "dual"), ("demo-block", DEMO_BLOCK_MODEL_DIR, "block")):
        got = json.loads(ok("info", alias))
        assert got["folder"] == folder and got["decoding_defaults"]["cache"] == cache
    code, _, err = run("info", str(tmp_path / "nope"))
    assert code == 2 and "'demo' and 'demo-block'" in err, err

    # generate / bench / profile: the demo model's defaults (gen 16, block 16, threshold, dual) answer
    assert ok("generate", "--prompt", "add 123+045=").splitlines() == ["0168"]
    assert ok("generate", "--model", "demo-block", "--prompt", "sort 5391=").splitlines() == ["1359"]
    assert "argmax per position" in ok("logits", "--model", "demo", "--prompt-ids", "5,6,7")
    rows = json.loads(ok("bench", "--prompt-len", "8", "--repeats", "1", "--json"))
    assert [(r["batch"], r["strategy"], r["cache"]) for r in rows] == [(1, "threshold", "dual")]
    logdir = tmp_path / "prof"
    assert "--logdir" in ok("profile", "--prompt", "add 123+045=", "--logdir", str(logdir))
    assert any(f.endswith(".xplane.pb") for _, _, fs in os.walk(logdir) for f in fs)

    # eval demo: the default strategy x cache grid of both demo models, each setting checked against its
    # model (spec_for -> check_model) by a stand-in for the decoding; then one real small run
    seen = []

    def checked_run(model, tok, prompt_ids, sp, batch_size=32, warmup=True):
        sp.spec_for(model.config)
        seen.append((os.path.basename(model.folder), sp.strategy, sp.cache))
        n = len(prompt_ids)
        return ev.Run([""] * n, [[]] * n, [1] * n, [0] * n, 1.0, 0.0, [0] * n)

    with monkeypatch.context() as m:
        m.setattr(ev, "run_prompts", checked_run)
        ok("eval", "demo", "--n", "2")
    demo_rows = {(s, c) for f, s, c in seen if f == "demo_model"}
    assert demo_rows == {(s, c) for s in ev.STRATEGY_SETTINGS for c in ("none", "prefix", "dual", "vicinity")}
    assert [c for f, _, c in seen if f == "demo_block_model"] == ["block"] * len(ev.BLOCK_SETTINGS)
    res = json.loads(ok("eval", "demo", "--n", "2", "--model", "demo", "--strategy", "threshold", "--cache", "dual",
                        "--json"))
    assert [(r["strategy"], r["cache"], r["accuracy"]) for r in res["rows"]] == [("threshold", "dual", 1.0)]

    # the HF round trip leaves no temporary folder behind (plan: --help above; it compiles for a TPU)
    before = set(os.listdir(tmp_path / "tmp"))
    assert "logits identical = True" in ok("demo")
    assert set(os.listdir(tmp_path / "tmp")) == before

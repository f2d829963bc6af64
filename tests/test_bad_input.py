"""Bad input through every entry point: the CLI (exit 2, one line naming the flag / file), the
library (ValueError naming the field) and the server (HTTP 400 naming the field); no traceback,
and nothing written or changed on disk.

The CLI runs in-process (`cli.main`), so an unexpected exception fails the test instead of being
hidden in a subprocess's stderr; the server is the real FastAPI app behind Starlette's TestClient.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import shutil

import pytest

from dinfer_jax import cli
from dinfer_jax.checkpoint import DEMO_MODEL_DIR
from dinfer_jax.engine import InvalidParam, SamplingParams

NAN, INF = float("nan"), float("inf")


def run_cli(argv):
    """(exit code, stdout, stderr) of `dinfer-jax ARGV`, in-process."""
    out, err, code = io.StringIO(), io.StringIO(), 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            cli.main(argv)
        except SystemExit as e:
            code = e.code
    return code, out.getvalue(), err.getvalue()


def assert_cli_error(argv, needle):
    code, out, err = run_cli(argv)
    lines = err.strip().splitlines()
    assert code == 2, (argv, code, err)
    assert len(lines) == 1 and lines[0].startswith("dinfer-jax: error: "), err
    assert needle in lines[0], (needle, err)
    return lines[0]


def snapshot(root) -> dict:
    """{relative path: (size, mtime_ns, bytes if small)} of every file under root (and the folders)."""
    out = {}
    for d, dirs, files in os.walk(root):
        for n in dirs:
            out[os.path.relpath(os.path.join(d, n), root)] = "dir"
        for n in files:
            p = os.path.join(d, n)
            st = os.stat(p)
            out[os.path.relpath(p, root)] = (st.st_size, st.st_mtime_ns)
    return out


@pytest.fixture(scope="module")
def demo():
    from dinfer_jax import load_model
    return load_model(DEMO_MODEL_DIR)


@pytest.fixture(scope="module")
def client(demo):
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from dinfer_jax.chat import ChatFormatter
    from dinfer_jax.serving.scheduler import ServerConfig
    from dinfer_jax.serving.http import create_app
    from dinfer_jax.tokenizer import load_tokenizer
    cfg = ServerConfig(model_name="demo_model", default_params=SamplingParams(gen_length=16, block_length=16),
                       default_max_tokens=16)
    app = create_app(demo, load_tokenizer(DEMO_MODEL_DIR), cfg, ChatFormatter(DEMO_MODEL_DIR, demo.config.family))
    with TestClient(app) as c:
        yield c


# ---------------------------------------------------------------------------------------------
# Decoding settings: (field, SamplingParams kwargs, CLI flags or None, server body fields or None, needle)

SETTINGS = [
    ("threshold", dict(threshold=NAN), ["--threshold", "nan"], dict(threshold=NAN), "threshold=nan must be in (0.0, 1.0]"),
    ("threshold", dict(threshold=0.0), ["--threshold", "0"], dict(threshold=0), "threshold=0.0 must be in (0.0, 1.0]"),
    ("threshold", dict(threshold=1.5), ["--threshold", "1.5"], dict(threshold=1.5), "threshold=1.5"),
    ("threshold", dict(threshold=INF), ["--threshold", "inf"], dict(threshold=INF), "threshold=inf"),
    ("threshold", dict(threshold="0.9"), None, None, "threshold='0.9' must be a number"),
    ("temperature", dict(temperature=INF), ["--temperature", "inf"], dict(temperature=INF), "temperature=inf must be in [0.0, 1000.0]"),
    ("temperature", dict(temperature=NAN), ["--temperature", "nan"], dict(temperature=NAN), "temperature=nan"),
    ("temperature", dict(temperature=-1.0), ["--temperature", "-1"], dict(temperature=-1), "temperature=-1.0 must be in [0.0, 1000.0]"),
    # bounded where fp32 arithmetic stays finite (logits / T, T * Gumbel noise; knobs travel as fp32)
    ("temperature", dict(temperature=1e308), ["--temperature", "1e308"], dict(temperature=1e308),
     "temperature=1e+308 must be in [0.0, 1000.0]"),
    ("temperature", dict(temperature=1e-9), ["--temperature", "1e-9"], dict(temperature=1e-9),
     "temperature=1e-09 must be 0 (greedy) or in [0.001, 1000]"),
    ("factor", dict(factor=1e308), ["--factor", "1e308"], dict(factor=1e308), "factor=1e+308 must be in (0.0, 1e+06]"),
    ("low_threshold", dict(low_threshold=2.0), ["--low-threshold", "2"], dict(low_threshold=2), "low_threshold=2.0"),
    ("low_threshold", dict(low_threshold=0.0), ["--low-threshold", "0"], dict(low_threshold=0), "low_threshold=0.0"),
    ("factor", dict(factor=0.0), ["--factor", "0"], dict(factor=0), "factor=0.0 must be in (0.0, 1e+06]"),
    ("factor", dict(factor=-1.0), ["--factor", "-1"], dict(factor=-1), "factor=-1.0 must be in (0.0, 1e+06]"),
    ("factor", dict(factor=NAN), ["--factor", "nan"], dict(factor=NAN), "factor=nan"),
    ("seed", dict(seed=-1), ["--seed", "-1"], dict(seed=-1), "seed=-1 must be in [0, 2**32)"),
    ("seed", dict(seed=2**32), ["--seed", str(2**32)], dict(seed=2**32), "seed=4294967296"),
    ("seed", dict(seed=1.5), None, None, "seed=1.5 must be an integer"),
    ("gen_length", dict(gen_length="16"), None, None, "gen_length='16' must be an integer in [1, 16777216]"),
    ("gen_length", dict(gen_length=True), None, None, "gen_length=True must be an integer"),
    ("gen_length", dict(gen_length=0), None, None, "gen_length=0 must be in [1, 16777216]"),
    ("block_length", dict(block_length=-8), None, dict(block_length=-8), "block_length=-8 must be in [1, 16777216]"),
    ("block_length", dict(block_length=0), None, dict(block_length=0), "block_length=0 must be in [1, 16777216]"),
    ("steps", dict(steps=0), None, dict(steps=0), "steps=0 must be in [1, 16777216]"),
    ("strategy", dict(strategy="beam"), None, None, "strategy='beam' is not one of"),
    ("cache", dict(cache=None), None, None, "cache=None is not one of"),
    ("smoothing", dict(smoothing="yes"), None, None, "smoothing='yes' must be true or false"),
    ("cont_weight", dict(cont_weight=2.0), None, None, "cont_weight=2.0"),
    ("credit_beta", dict(credit_beta=-0.1), None, None, "credit_beta=-0.1"),
    ("prefix_look", dict(prefix_look=-1), None, None, "prefix_look=-1"),
    ("min_tokens", dict(min_tokens=-1), ["--min-tokens", "-1"], dict(min_tokens=-1), "min_tokens=-1 must be in [0, 16777216]"),
    ("ignore_eos", dict(ignore_eos="yes"), None, None, "ignore_eos='yes' must be true or false"),
    ("eb_threshold", dict(strategy="entropy_bounded", cache="block", eb_threshold=0.0),
     ["--strategy", "entropy_bounded", "--cache", "block", "--eb-threshold", "0"],
     dict(strategy="entropy_bounded", cache="block", eb_threshold=0), "eb_threshold=0.0 must be in (0.0, 1e+06]"),
    ("eb_threshold", dict(strategy="entropy_bounded", cache="block", eb_threshold=NAN),
     ["--strategy", "entropy_bounded", "--cache", "block", "--eb-threshold", "nan"],
     dict(strategy="entropy_bounded", cache="block", eb_threshold=NAN), "eb_threshold=nan must be in (0.0, 1e+06]"),
]
# Rules between fields, checked when a program is chosen (spec): library via generate().
CROSS = [
    ("gen_length", dict(gen_length=20, block_length=8), ["--gen-length", "20", "--block-length", "8"], None,
     "gen_length=20 must be a positive multiple of block_length=8"),
    ("steps", dict(gen_length=16, block_length=8, strategy="fixed", steps=3),
     ["--gen-length", "16", "--block-length", "8", "--strategy", "fixed", "--steps", "3"],
     dict(block_length=8, strategy="fixed", steps=3), "steps=3 must be a positive multiple of the number of blocks (2)"),
    ("smoothing", dict(smoothing=True, cache="prefix"), ["--smoothing", "--cache", "prefix"],
     dict(smoothing=True, cache="prefix"), "iteration smoothing with the prefix cache is not supported"),
    ("min_tokens", dict(gen_length=16, block_length=16, min_tokens=17), ["--gen-length", "16", "--min-tokens", "17"],
     dict(min_tokens=17), "min_tokens=17 exceeds gen_length=16"),
    ("strategy", dict(strategy="sequential", cache="dual"), ["--strategy", "sequential", "--cache", "dual"],
     dict(strategy="sequential", cache="dual"), "strategy 'sequential' (SDAR's remasking) applies to block diffusion"),
    ("eb_threshold", dict(eb_threshold=0.5), ["--eb-threshold", "0.5"], dict(eb_threshold=0.5),
     "eb_threshold=0.5 applies to strategy 'entropy_bounded' only"),
]
IDS = [f"{c[0]}-{i}" for i, c in enumerate(SETTINGS + CROSS)]


@pytest.mark.parametrize("field,kw,flags,body,needle", SETTINGS + CROSS, ids=IDS)
def test_library_rejects_settings(demo, field, kw, flags, body, needle):
    from dinfer_jax import generate
    with pytest.raises(InvalidParam) as e:
        generate(demo, [[5, 6, 7]], SamplingParams(**kw))  # per-field rules fire in the constructor
    assert e.value.field == field and needle in str(e.value)
    assert isinstance(e.value, ValueError)


@pytest.mark.parametrize("field,kw,flags,body,needle", [c for c in SETTINGS + CROSS if c[2]],
                         ids=[i for i, c in zip(IDS, SETTINGS + CROSS) if c[2]])
def test_cli_rejects_settings(field, kw, flags, body, needle):
    line = assert_cli_error(["generate", "--prompt", "add 123+045="] + flags, needle)
    assert line.startswith(f"dinfer-jax: error: --{field.replace('_', '-')}: ")


@pytest.mark.parametrize("field,kw,flags,body,needle", [c for c in SETTINGS + CROSS if c[3]],
                         ids=[i for i, c in zip(IDS, SETTINGS + CROSS) if c[3]])
def test_server_rejects_settings(client, field, kw, flags, body, needle):
    payload = json.dumps({"prompt": "add 123+045=", "max_tokens": 16, **body})  # NaN / Infinity as Python writes them
    r = client.post("/v1/completions", content=payload, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and needle in err["message"], err


def test_server_type_errors_name_the_field(client):
    for body, field in (({"seed": 1.5}, "seed"), ({"strategy": "beam"}, "strategy"), ({"threshold": "x"}, "threshold")):
        r = client.post("/v1/completions", json={"prompt": "add 1+2=", **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text


# ---------------------------------------------------------------------------------------------
# Prompts

LIB_PROMPTS = [
    ([[]], "prompt 0 is empty"),
    ([[5, 6], []], "prompt 1 is empty"),
    ("add 1+2=", "prompts must be token ids, got text"),
    (["add 1+2="], "prompts must be token ids, got text"),
    ([[5.0, 6.0]], "prompt 0: token ids must be integers, got dtype float64"),
    ([[5, 1]], "prompt contains the mask token id 1"),
    ([[5, 999]], "token id 999 is out of the vocabulary"),
    (7, "prompts must be a list of token-id lists or an array, got int"),
    ([[5, [6, 7]]], "prompt 0 is not a flat sequence"),
]


@pytest.mark.parametrize("prompts,needle", LIB_PROMPTS, ids=[str(i) for i in range(len(LIB_PROMPTS))])
def test_library_rejects_prompts(demo, prompts, needle):
    from dinfer_jax import generate
    with pytest.raises(InvalidParam) as e:
        generate(demo, prompts, SamplingParams(gen_length=16, block_length=16))
    assert e.value.field == "prompt" and needle in str(e.value), str(e.value)


def test_library_rejects_non_params(demo):
    from dinfer_jax import generate
    with pytest.raises(InvalidParam, match="params must be SamplingParams"):
        generate(demo, [[5, 6]], {"threshold": 0.5})


def test_tokenizer_rejects_special_tokens_and_unknown_characters():
    from dinfer_jax.tokenizer import load_tokenizer
    tok = load_tokenizer(DEMO_MODEL_DIR)
    with pytest.raises(ValueError, match=r"prompt contains the special token '<\|endoftext\|>' as text"):
        tok.encode_prompt("add 1+2=<|endoftext|>")
    with pytest.raises(ValueError, match="prompt has 2 character\\(s\\) the tokenizer does not know: 'é', '€'"):
        tok.encode_prompt("héllo €")
    assert tok.encode_prompt("add 1+2=") == tok.encode("add 1+2=")
    assert tok.encode_prompt("<|endoftext|>x", allow_special=True) == [0, tok.token_to_id("x")]  # template text


@pytest.mark.parametrize("flags,needle", [
    (["--prompt", "add 123+045=<|endoftext|>"], "--prompt contains the special token '<|endoftext|>' as text"),
    (["--prompt", "add 123+045=é"], "--prompt has 1 character(s) the tokenizer does not know: 'é'"),
    (["--prompt", ""], "--prompt is empty"),
    (["--prompt-ids", "5,1"], "--prompt: prompt contains the mask token id 1"),
    (["--prompt-ids", "5,999"], "token id 999 is out of the vocabulary"),
])
def test_cli_rejects_prompts(flags, needle):
    assert_cli_error(["generate"] + flags, needle)


@pytest.mark.parametrize("body,param,needle", [
    ({"prompt": "add 1+2=<|endoftext|>"}, "prompt", "special token '<|endoftext|>'"),
    ({"prompt": "add 1+2=é"}, "prompt", "does not know: 'é'"),
    ({"prompt": []}, "prompt", "prompt is empty"),
    ({"prompt": [5, 1]}, "prompt", "mask token"),
    ({"messages": [{"role": "user", "content": "hi<|mdm_mask|>"}]}, "messages[0].content", "special token '<|mdm_mask|>'"),
])
def test_server_rejects_prompts(client, body, param, needle):
    url = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    r = client.post(url, json={"max_tokens": 16, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and needle in err["message"], err


# ---------------------------------------------------------------------------------------------
# Folders and files: library errors, CLI one-liners, and nothing changed on disk


@pytest.fixture(scope="module")
def ckpt_dir(tmp_path_factory, moe_hf_dir):
    from converters import convert
    d = str(tmp_path_factory.mktemp("bad_input") / "ck")
    convert(moe_hf_dir, d, progress=False)
    return d


def _copy(src, dst):
    shutil.copytree(src, dst)
    return str(dst)


def test_load_model_rejects_bad_paths(tmp_path):
    from dinfer_jax import load_model
    from dinfer_jax.config import ConfigError
    with pytest.raises(ValueError, match="model folder must be a path"):
        load_model(None)
    f = tmp_path / "weights.bin"
    f.write_bytes(b"x")
    with pytest.raises(ConfigError, match="is a file, not a folder"):
        load_model(str(f))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_model(str(tmp_path / "nope"))


def test_broken_folders(tmp_path, ckpt_dir):
    """Each broken folder: the library's error, the CLI's line (info and generate), and no change on disk."""
    from dinfer_jax import load_model
    from dinfer_jax.config import ConfigError
    listcfg = tmp_path / "listcfg"
    listcfg.mkdir()
    (listcfg / "config.json").write_text("[1, 2]")
    truncated = _copy(ckpt_dir, tmp_path / "truncated")
    with open(os.path.join(truncated, "dinfer_jax.json"), "r+") as f:
        text = f.read()
        f.seek(0), f.truncate(), f.write(text[: len(text) // 2])
    params_only = tmp_path / "params_only"  # a convert killed before config.json
    shutil.copytree(os.path.join(ckpt_dir, "params"), params_only / "params")
    no_manifest = _copy(ckpt_dir, tmp_path / "no_manifest")  # killed between config.json and the manifest
    os.remove(os.path.join(no_manifest, "dinfer_jax.json"))
    cases = [  # (folder, needle, does `info` read the broken file)
        (str(listcfg), "the top level must be a JSON object {...}, got a list", True),
        (truncated, "dinfer_jax.json: not valid JSON", False),
        (str(params_only), "incomplete dinfer-jax checkpoint (conversion did not finish)", True),
        (no_manifest, "incomplete dinfer-jax checkpoint (conversion did not finish)", True),
    ]
    for folder, needle, info_reads_it in cases:
        before = snapshot(folder)
        with pytest.raises(ConfigError) as e:
            load_model(folder)
        assert needle in str(e.value), (folder, str(e.value))
        if info_reads_it:
            assert_cli_error(["info", folder], needle)
        assert_cli_error(["generate", "--model", folder, "--prompt-ids", "5,6"], needle)
        assert snapshot(folder) == before, folder
    f = tmp_path / "model.safetensors"
    f.write_bytes(b"x")
    assert_cli_error(["generate", "--model", str(f), "--prompt", "hi"], "is a file, not a folder")
    assert_cli_error(["info", str(f)], "is a file, not a folder")


def test_convert_and_export_refuse_bad_destinations(tmp_path, moe_hf_dir, ckpt_dir, monkeypatch):
    from converters import convert, export
    src_before, ck_before = snapshot(moe_hf_dir), snapshot(ckpt_dir)
    full = tmp_path / "full"
    full.mkdir()
    (full / "tokenizer.json").write_text("old")
    (full / "generation_config.json").write_text("{}")
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    ro = tmp_path / "ro"
    ro.mkdir()
    for cmd, src in (("convert", moe_hf_dir), ("export", ckpt_dir)):
        before = snapshot(tmp_path)
        assert_cli_error([cmd, src, str(full), "--quiet"], "destination exists and is not empty (pass --overwrite")
        assert_cli_error([cmd, src, str(blocker), "--quiet"], "destination exists and is not a folder")
        assert_cli_error([cmd, src, str(blocker / "sub"), "--quiet"], "Not a directory")
        assert_cli_error([cmd, str(tmp_path / "missing"), str(tmp_path / "new"), "--quiet"], "does not exist")
        assert_cli_error([cmd, src, os.path.join(src, "inside"), "--quiet"], "overlap")
        real_mkdir = os.mkdir

        def read_only(path, *a, **k):  # as root, chmod cannot make a folder read-only: refuse writes here
            if os.path.abspath(path).startswith(str(ro)):
                raise PermissionError(13, "Permission denied", path)
            return real_mkdir(path, *a, **k)
        monkeypatch.setattr(os, "mkdir", read_only)
        line = assert_cli_error([cmd, src, str(ro / "out"), "--quiet"], "Permission denied")
        assert str(ro) in line
        monkeypatch.setattr(os, "mkdir", real_mkdir)
        assert snapshot(tmp_path) == before, cmd
    with pytest.raises(FileExistsError):
        convert(moe_hf_dir, str(full), progress=False)
    with pytest.raises(FileExistsError):
        export(ckpt_dir, str(full), progress=False)
    assert snapshot(moe_hf_dir) == src_before and snapshot(ckpt_dir) == ck_before


def test_export_overwrite_replaces_the_folder_whole(tmp_path, ckpt_dir):
    """The old folder's tokenizer.json / generation_config.json must not survive an overwrite."""
    dst = tmp_path / "hf"
    dst.mkdir()
    (dst / "tokenizer.json").write_text("stale")
    (dst / "generation_config.json").write_text('{"eos_token_id": 5}')
    (dst / "model-00001-of-00099.safetensors").write_text("stale")
    code, out, err = run_cli(["export", ckpt_dir, str(dst), "--quiet", "--overwrite"])
    assert code == 0, err
    files = set(os.listdir(dst))
    assert not {"tokenizer.json", "generation_config.json", "model-00001-of-00099.safetensors"} & files
    assert {"config.json", "model.safetensors"} <= files  # the tiny model fits one file: no index
    assert {f for f in files if "safetensors" in f} == {"model.safetensors"}
    assert not [e for e in os.listdir(tmp_path) if e.startswith(".hf")]  # no temporary siblings left


def test_export_bad_max_shard_size(tmp_path, ckpt_dir):
    for bad in ("5XB", "1.5GB", "0"):
        code, out, err = run_cli(["export", ckpt_dir, str(tmp_path / "hf"), "--quiet", "--max-shard-size", bad])
        assert code == 2 and f"argument --max-shard-size: size '{bad}'" in err, err
        assert not (tmp_path / "hf").exists()


def test_profile_unwritable_logdir(tmp_path):
    f = tmp_path / "f"
    f.write_text("x")
    assert_cli_error(["profile", "--prompt", "add 1+2=", "--logdir", str(f / "prof")], "--logdir")


def test_gen_length_off_the_model_defaults_warns():
    code, out, err = run_cli(["generate", "--prompt", "add 123+045=", "--gen-length", "32"])
    assert code == 0, err
    assert "warning: --gen-length 32 (default 16): not the generation defaults of this model" in err
    code, out, err = run_cli(["generate", "--prompt", "add 123+045="])
    assert code == 0 and out.strip() == "0168" and "warning" not in err


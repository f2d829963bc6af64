"""Converters: every input layout gives identical params; HF -> dinfer-jax -> HF is bit-exact;
bad checkpoints fail with one clear message."""
import json
import os
import shutil
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from converters import ConversionError, convert, export, load_hf_params
from dinfer_jax import load_model
from dinfer_jax.config import ConfigError
from hf_reference import fuse_experts, write_hf_folder  # noqa: E402


def _same_params(a: dict, b: dict):
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        np.testing.assert_array_equal(a[k].view(np.uint8), b[k].view(np.uint8), err_msg=k)


@pytest.fixture(scope="module")
def moe_params(moe_hf_dir):
    return load_hf_params(moe_hf_dir)[1]


@pytest.mark.parametrize("fmt,shards", [("safetensors", 3), ("bin", 1), ("bin", 2)])
def test_layouts_give_identical_params(tmp_path, moe_ref, moe_params, fmt, shards):
    cfg, _, sd = moe_ref
    write_hf_folder(str(tmp_path), cfg, sd, fmt=fmt, shards=shards)
    _same_params(load_hf_params(str(tmp_path))[1], moe_params)


def test_fused_and_unfused_layouts_identical(tmp_path, moe_ref, moe_params):
    cfg, _, sd = moe_ref
    fused = fuse_experts(sd, cfg.num_layers, cfg.num_experts)
    assert "model.layers.0.mlp.w1" in fused and fused["model.layers.0.mlp.w1"].shape == (
        cfg.num_experts, 2 * cfg.intermediate_size, cfg.hidden_size)
    from dinfer_jax.families import to_hf_dict
    write_hf_folder(str(tmp_path), cfg, fused, shards=2,
                    hf_config={**to_hf_dict(cfg), "architectures": ["FusedLLaDAMoEModelLM"]})
    _same_params(load_hf_params(str(tmp_path))[1], moe_params)


@pytest.mark.parametrize("dtype,max_shard_size", [(torch.bfloat16, "5GB"), (torch.float16, "20KB"),
                                                  (torch.float32, "5GB")])
def test_round_trip_bit_exact(tmp_path, moe_ref, dtype, max_shard_size):
    """HF -> checkpoint -> HF is bit-exact, exported as one file or in shards; and HF -> checkpoint
    -> HF -> checkpoint gives the first checkpoint's params."""
    from safetensors.numpy import load_file as np_load  # independent reader (not ours)
    from dinfer_jax import checkpoint as ckpt
    cfg, _, sd = moe_ref
    src, mid, back = (str(tmp_path / n) for n in ("src", "mid", "back"))
    write_hf_folder(src, cfg, sd, shards=2, dtype=dtype)
    (tmp_path / "src" / "tokenizer.json").write_text('{"fake": true}')
    convert(src, mid, progress=False)
    files = export(mid, back, progress=False, max_shard_size=max_shard_size)
    assert (len(files) > 1) == (max_shard_size == "20KB")
    want = {k: v.to(dtype).contiguous() for k, v in sd.items()}
    got = {}
    for f in os.listdir(back):
        if f.endswith(".safetensors"):
            if dtype == torch.bfloat16:
                from safetensors.torch import load_file
                got.update(load_file(os.path.join(back, f)))
            else:
                got.update({k: torch.from_numpy(v) for k, v in np_load(os.path.join(back, f)).items()})
    assert got.keys() == want.keys()
    for k in want:
        assert got[k].dtype == dtype and torch.equal(got[k].view(torch.uint8), want[k].view(torch.uint8)), k
    assert json.load(open(os.path.join(back, "config.json"))) == json.load(open(os.path.join(src, "config.json")))
    assert os.path.isfile(os.path.join(back, "tokenizer.json")) and os.path.isfile(os.path.join(mid, "tokenizer.json"))
    if len(files) > 1:
        idx = json.load(open(os.path.join(back, "model.safetensors.index.json")))
        assert set(idx["weight_map"]) == set(want) and set(idx["weight_map"].values()) == set(files)
    else:
        assert files == ["model.safetensors"] and not os.path.exists(os.path.join(back, "model.safetensors.index.json"))
    again = str(tmp_path / "again")
    convert(back, again, progress=False)
    a, b = ckpt.read_params(mid), ckpt.read_params(again)
    assert a.keys() == b.keys()
    for k in a:
        x, y = np.asarray(a[k]), np.asarray(b[k])
        assert x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes(), k


# ---------------------------------------------------------------------------- export shards


def test_parse_size_matches_transformers():
    from transformers.utils.hub import convert_file_size_to_int
    from converters.safetensors_io import parse_size
    for size in ["5GB", "500MB", "2GiB", "3MiB", "1KiB", "10KB", "5Gb", "80mb", "7kb", 12345]:
        assert parse_size(size) == convert_file_size_to_int(size), size
    assert parse_size("12345") == 12345  # digits alone (a CLI argument): bytes
    for bad in ["5XB", "1.5GB", "GB", "", "0", "0MB", -3, "-1GB"]:
        with pytest.raises(ValueError, match="size"):
            parse_size(bad)


def _header_order(path):
    """(name, nbytes) of a safetensors file in data order."""
    import struct
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return [(k, v["data_offsets"][1] - v["data_offsets"][0])
            for k, v in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0])]


def test_export_shards_by_size(tmp_path):
    """The demo model exports to one model.safetensors; with a small --max-shard-size to shards
    split as huggingface_hub splits them, whose index lists every tensor once with the right
    total_size; convert reads them back to the same params, bit for bit."""
    from huggingface_hub import split_state_dict_into_shards_factory
    from safetensors.numpy import load_file as np_load
    from dinfer_jax import checkpoint as ckpt
    from dinfer_jax.checkpoint import DEMO_MODEL_DIR
    from dinfer_jax.cli import main
    one, many = tmp_path / "one", tmp_path / "many"
    assert main(["export", DEMO_MODEL_DIR, str(one), "--quiet"]) in (0, None)
    assert sorted(f for f in os.listdir(one) if "safetensors" in f) == ["model.safetensors"]
    want = np_load(str(one / "model.safetensors"))
    order = _header_order(str(one / "model.safetensors"))  # the order tensors are written in
    limit = 100_000
    assert main(["export", DEMO_MODEL_DIR, str(many), "--quiet", "--max-shard-size", "100KB"]) in (0, None)
    index = json.load(open(many / "model.safetensors.index.json"))
    wm = index["weight_map"]
    files = sorted(f for f in os.listdir(many) if f.endswith(".safetensors"))
    n = len(files)
    assert n > 2 and files == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    assert sorted(wm) == sorted(want) and set(wm.values()) == set(files)
    got, seen = {}, []
    for f in files:
        part = np_load(str(many / f))
        assert all(wm[k] == f for k in part), f  # a tensor is in the file the index names, and only there
        seen += list(part)
        got.update(part)
        nbytes = sum(v.nbytes for v in part.values())
        assert nbytes <= limit or len(part) == 1, (f, nbytes)
    assert sorted(seen) == sorted(want)  # every tensor exactly once
    assert index["metadata"]["total_size"] == sum(v.nbytes for v in want.values())
    for k in want:
        assert got[k].dtype == want[k].dtype and got[k].tobytes() == want[k].tobytes(), k
    hub = split_state_dict_into_shards_factory(dict(order), get_storage_size=lambda nb: nb, max_shard_size=limit,
                                               filename_pattern="model{suffix}.safetensors")
    assert {f: sorted(ks) for f, ks in hub.filename_to_tensors.items()} == {
        f: sorted(k for k in wm if wm[k] == f) for f in files}
    assert hub.metadata["total_size"] == index["metadata"]["total_size"]
    back = tmp_path / "ck"
    convert(str(many), str(back), progress=False)
    a, b = ckpt.read_params(DEMO_MODEL_DIR), ckpt.read_params(str(back))
    assert a.keys() == b.keys()
    for k in a:
        x, y = np.asarray(a[k]), np.asarray(b[k])
        assert x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes(), k


def test_transformers_loads_sharded_export(tmp_path, moe_ref, moe_hf_dir):
    """transformers' from_pretrained reads a sharded export (index + shards) into Qwen3MoeForCausalLM:
    nothing missing or unexpected, every weight equal to the reference model's."""
    cfg, ref, _ = moe_ref
    from transformers import Qwen3MoeForCausalLM
    convert(moe_hf_dir, str(tmp_path / "ck"), progress=False)
    files = export(str(tmp_path / "ck"), str(tmp_path / "hf"), progress=False, max_shard_size="20KB")
    assert len(files) > 2
    model, info = Qwen3MoeForCausalLM.from_pretrained(str(tmp_path / "hf"), config=ref.config,
                                                      output_loading_info=True)
    assert not any(info.values()), info
    a, b = ref.state_dict(), model.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def test_dense_round_trip_and_checkpoint_logits(tmp_path, dense_hf_dir, dense_model, rng):
    ck, back = str(tmp_path / "ck"), str(tmp_path / "back")
    convert(dense_hf_dir, ck, progress=False)
    export(ck, back, progress=False)
    _same_params(load_hf_params(back)[1], load_hf_params(dense_hf_dir)[1])
    ids = rng.randint(0, dense_model.config.vocab_size, (1, 9))
    np.testing.assert_array_equal(load_model(ck).logits(ids), dense_model.logits(ids))


def test_convert_with_dtype_cast(tmp_path, moe_hf_dir):
    convert(moe_hf_dir, str(tmp_path / "ck"), dtype=np.dtype(ml_dtypes.bfloat16), progress=False)
    man = json.load(open(tmp_path / "ck" / "dinfer_jax.json"))
    assert {s["dtype"] for s in man["params"].values()} == {"bfloat16"}


def test_tied_embeddings_llada(tmp_path, rng):
    """LLaDA with weight_tying=true: no ff_out LM head tensor; logits use wte^T (vs tied Llama)."""
    from conftest import DENSE_CFG
    from hf_reference import bidirectional_logits, llada_state_dict, llama_reference
    cfg = DENSE_CFG.replace(tie_word_embeddings=True)
    ref = llama_reference(cfg, seed=5)
    sd = llada_state_dict(ref, tied=True)
    assert "model.transformer.ff_out.weight" not in sd
    write_hf_folder(str(tmp_path), cfg, sd)
    ids = rng.randint(0, cfg.vocab_size, (1, 8))
    r, o = bidirectional_logits(ref, ids), load_model(str(tmp_path)).logits(ids)
    assert np.abs(r - o).max() <= 1e-4 * np.abs(r).max()


# ---------------------------------------------------------------------------- bad inputs


@pytest.fixture
def hf_copy(tmp_path, moe_hf_dir):
    d = tmp_path / "hf"
    shutil.copytree(moe_hf_dir, d)
    return d


def test_truncated_safetensors(hf_copy):
    f = hf_copy / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) - 100])
    with pytest.raises(ConversionError, match=r"model.safetensors: file is truncated: its header declares \d+ bytes, the file has \d+"):
        load_hf_params(str(hf_copy))
    f.write_bytes(data[:20])
    with pytest.raises(ConversionError, match="model.safetensors: file is truncated"):
        load_hf_params(str(hf_copy))


def _rewrite(folder, cfg, sd):
    os.remove(os.path.join(folder, "model.safetensors"))
    write_hf_folder(str(folder), cfg, sd)


def test_missing_unexpected_and_wrong_shape_listed_together(hf_copy, moe_ref):
    cfg, _, sd = moe_ref
    bad = dict(sd)
    del bad["model.layers.1.mlp.experts.3.up_proj.weight"]
    bad["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(5, cfg.hidden_size)
    bad["model.layers.0.mlp.shared_expert.weight"] = torch.zeros(2)
    _rewrite(hf_copy, cfg, bad)
    with pytest.raises(ConversionError) as e:
        load_hf_params(str(hf_copy))
    msg = str(e.value)
    assert "1 missing tensors:\n  model.layers.1.mlp.experts.3.up_proj.weight" in msg
    assert "1 unexpected tensors:\n  model.layers.0.mlp.shared_expert.weight" in msg
    assert "model.layers.0.self_attn.k_proj.weight: expected shape [32, 64], found [5, 64]" in msg


def test_unknown_architecture_in_folder(hf_copy):
    cfg = json.loads((hf_copy / "config.json").read_text())
    (hf_copy / "config.json").write_text(json.dumps({**cfg, "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ConfigError, match="unknown architecture 'GPT2LMHeadModel'"):
        load_model(str(hf_copy))


def test_missing_shard_and_empty_folder(tmp_path, moe_ref):
    cfg, _, sd = moe_ref
    write_hf_folder(str(tmp_path / "s"), cfg, sd, shards=2)
    os.remove(tmp_path / "s" / "model-00002-of-00002.safetensors")
    with pytest.raises(ConversionError, match="names shard files that are missing: model-00002-of-00002.safetensors"):
        load_hf_params(str(tmp_path / "s"))
    (tmp_path / "e").mkdir()
    (tmp_path / "e" / "config.json").write_text((tmp_path / "s" / "config.json").read_text())
    with pytest.raises(ConversionError, match=r"no \*.safetensors or \*.bin weight files"):
        load_hf_params(str(tmp_path / "e"))


def test_corrupt_bin(hf_copy):
    os.remove(hf_copy / "model.safetensors")
    (hf_copy / "pytorch_model.bin").write_bytes(b"not a zip file at all")
    with pytest.raises(ConversionError, match="pytorch_model.bin: cannot load as a PyTorch checkpoint"):
        load_hf_params(str(hf_copy))


def test_destination_not_empty(tmp_path, moe_hf_dir):
    (tmp_path / "x").write_text("keep me")
    with pytest.raises(FileExistsError, match="destination exists and is not empty"):
        convert(moe_hf_dir, str(tmp_path), progress=False)


def test_cli_convert_and_errors(tmp_path, moe_hf_dir):
    exe = [sys.executable, "-m", "dinfer_jax.cli"]
    ok = subprocess.run(exe + ["convert", moe_hf_dir, str(tmp_path / "ck"), "--quiet"], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    assert "wrote 15 parameters" in ok.stdout
    bad = subprocess.run(exe + ["logits", "--model", str(tmp_path / "nope"), "--prompt-ids", "1,2"],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "dinfer-jax: error: model folder" in bad.stderr and "Traceback" not in bad.stderr
    oov = subprocess.run(exe + ["logits", "--model", str(tmp_path / "ck"), "--prompt-ids", "1,99999", "--json"],
                         capture_output=True, text=True)
    assert oov.returncode == 2 and "token id 99999 is out of the vocabulary" in oov.stderr
    good = subprocess.run(exe + ["logits", "--model", str(tmp_path / "ck"), "--prompt-ids", "1,2,3", "--json"],
                          capture_output=True, text=True)
    assert good.returncode == 0, good.stderr
    assert json.loads(good.stdout)["shape"] == [3, 128]

"""Hub ids as --model (dinfer_jax/hub.py) against a Hugging Face cache built by hand in a tmp
folder (models--ORG--NAME/snapshots/<commit>/, refs/main); no network."""
from __future__ import annotations

import json
import os
import sys

import pytest

from dinfer_jax import cli, hub
from dinfer_jax.checkpoint import DEMO_MODEL_DIR

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(scope="module")
def hf_demo(tmp_path_factory):
    """The demo model exported as a Hugging Face safetensors folder (what a Hub snapshot holds)."""
    from converters import export
    d = str(tmp_path_factory.mktemp("hub_src") / "demo_hf")
    export(DEMO_MODEL_DIR, d, progress=False)
    return d


@pytest.fixture
def cache(tmp_path, monkeypatch, hf_demo):
    """HF_HUB_CACHE in tmp_path holding org/demo; offline. -> the snapshot folder."""
    root = tmp_path / "hub"
    repo = root / "models--org--demo"
    snap = repo / "snapshots" / COMMIT
    snap.mkdir(parents=True)
    for name in os.listdir(hf_demo):
        (snap / name).symlink_to(os.path.join(hf_demo, name))  # the real cache links snapshot files to blobs
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    monkeypatch.setenv("HF_HUB_CACHE", str(root))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return str(snap)


def test_hub_id_loads_the_cached_snapshot(cache, capsys):
    assert hub.resolve_model("org/demo") == cache
    cli.main(["info", "org/demo"])
    info = json.loads(capsys.readouterr().out)
    assert info["folder"] == cache and info["kind"] == "Hugging Face folder"
    cli.main(["generate", "--model", "org/demo", "--prompt", "add 123+045=", "--json"])
    assert json.loads(capsys.readouterr().out)["text"] == "0168"  # the demo model's answer, converted in memory


def test_uncached_id_is_one_line_with_the_download_command(cache, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["generate", "--model", "org/missing", "--prompt", "x"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and len(err.strip().splitlines()) == 1, err
    assert "'org/missing' is not a local folder and not in the Hugging Face cache" in err
    assert "offline (HF_HUB_OFFLINE is set)" in err
    assert err.strip().endswith("download it with: hf download org/missing")


def test_online_failure_falls_back_to_the_cache(cache, monkeypatch):
    """Online (HF_HUB_OFFLINE=0) with the download failing: the cached snapshot, else the reason."""
    import huggingface_hub
    real = huggingface_hub.snapshot_download
    calls = []

    def no_network(repo_id, local_files_only=False, **kw):
        calls.append(local_files_only)
        if not local_files_only:
            raise ConnectionError("the Hub cannot be reached")
        return real(repo_id, local_files_only=True, **kw)

    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr(huggingface_hub, "snapshot_download", no_network)
    assert hub.resolve_model("org/demo") == cache and calls == [False, True]
    with pytest.raises(hub.HubError, match=r"the Hub could not be reached \(ConnectionError: the Hub cannot be "
                                          r"reached\); download it with: hf download org/other"):
        hub.resolve_model("org/other")


def test_what_counts_as_a_hub_id(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "local" / "model").mkdir(parents=True)
    assert hub.is_repo_id("org/name") and hub.is_repo_id("GSAI-ML/LLaDA-8B-Instruct")
    for path in ("local/model", "/abs/org", "a/b/c", "./x", "org/", "name", "org/na--me", "org/..x", "-org/x"):
        assert not hub.is_repo_id(path), path
        assert hub.resolve_model(path) == path  # paths pass through (a missing one fails where it is used)
    assert hub.resolve_model(None) is None


def test_missing_huggingface_hub_is_a_clear_error(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)  # import fails
    with pytest.raises(SystemExit) as e:
        cli.main(["generate", "--model", "org/demo", "--prompt", "x"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "install huggingface_hub (pip install 'dinfer-jax[hub]')" in err

"""Every fenced code block of README.md and docs/*.md runs, unless the page marks it
`<!-- not-run: reason -->` (the comment right before the fence).

- ```python blocks are executed (their `# -> TEXT` comments must appear in their stdout, in that
  order); ```bash blocks line by line: `dinfer-jax ...` in-process through
  `cli.main` (exit 0; a `# -> TEXT` comment must appear in stdout), `dinfer-jax serve ... &` as a
  background server on a free port (stopped after the blocks that use it), `curl` as a subprocess.
- Placeholders: `path/to/checkpoint-or-hf-folder` and `ckpt/` -> the built-in demo model; port 8000
  -> a free port. Anything else in a runnable block fails the test: run it or mark it not-run.
- Fences without a language, or in json / text, are diagrams and data, and are not run.
"""
from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
import socket
import subprocess
import sys
import time

import pytest

from dinfer_jax.checkpoint import DEMO_MODEL_DIR

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
PAGES = [README] + sorted(os.path.join(ROOT, "docs", f) for f in os.listdir(os.path.join(ROOT, "docs"))
                          if f.endswith(".md"))
CODE_LANGS = {"bash", "sh", "shell", "python", "py"}
DATA_LANGS = {"json", "text"}  # data shown, never run (as fences without a language)
PLACEHOLDERS = {"path/to/checkpoint-or-hf-folder": DEMO_MODEL_DIR, "ckpt/": DEMO_MODEL_DIR + "/"}


def blocks(path=README) -> list[dict]:
    """Fenced blocks of one page: {page, line, lang, code, skip (the not-run reason or None)}."""
    lines = open(path, encoding="utf-8").read().splitlines()
    out, i, pending = [], 0, None
    while i < len(lines):
        s = lines[i].strip()
        if s.startswith("<!--"):
            comment = s
            while "-->" not in comment and i + 1 < len(lines):
                i += 1
                comment += " " + lines[i].strip()
            m = re.match(r"<!--\s*not-run:\s*(.*?)\s*-->", comment)
            pending = m.group(1) if m else pending
        elif s.startswith("```"):
            lang, start, code = s[3:].strip().lower(), i + 1, []
            i += 1
            while i < len(lines) and not lines[i].strip().startswith("```"):
                code.append(lines[i])
                i += 1
            out.append({"page": os.path.relpath(path, ROOT), "line": start, "lang": lang, "code": "\n".join(code),
                        "skip": pending})
            pending = None
        elif s:
            pending = None  # the marker must come right before its fence
        i += 1
    return out


def units() -> list[list[dict]]:
    """Runnable blocks in page order; a block that starts a server takes the blocks that use it."""
    out = []
    for b in (b for page in PAGES for b in blocks(page)):
        if b["skip"] or b["lang"] not in CODE_LANGS:
            continue
        if out and ":8000" in b["code"] and "serve" in out[-1][0]["code"] and "&" in out[-1][0]["code"]:
            out[-1].append(b)
        else:
            out.append([b])
    return out


def test_every_code_block_runs_or_says_why_not():
    found = [b for page in PAGES for b in blocks(page)]
    assert len(blocks()) >= 5 and len(found) >= 15, "the README / docs parse found too few blocks"
    for b in found:
        if b["skip"] is not None:
            assert len(b["skip"]) > 10, f"{b['page']}:{b['line']}: give the reason a block is not run"
        elif b["lang"]:
            assert b["lang"] in CODE_LANGS | DATA_LANGS, (f"{b['page']}:{b['line']}: ```{b['lang']} is not run by this test; "
                                             "use bash/python or mark it <!-- not-run: reason -->")
    assert sum(len(u) for u in units()) >= 5
    shown = [_shown(line) for b in found if b["lang"] in ("python", "py") and b["skip"] is None
             for line in b["code"].splitlines()]
    assert any(shown), "no runnable python block shows its output (# -> TEXT)"


def test_shown_output_is_checked():
    code = "print(x)  # -> 0168\nprint(y)  # -> 1359"
    _check_shown(code, "0168\n1359\n", "ok")
    for wrong in ("0167\n1359\n", "1359\n0168\n"):  # a wrong answer; the right ones in the wrong order
        with pytest.raises(AssertionError):
            _check_shown(code, wrong, "wrong")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _substitute(code: str, port: int) -> str:
    for k, v in PLACEHOLDERS.items():
        code = code.replace(k, v)
    return code.replace(":8000", f":{port}").replace("--port 8000", f"--port {port}")


def _shown(line: str) -> str | None:
    """The output a line shows in a `# -> TEXT` comment (TEXT up to the first space), or None."""
    m = re.search(r"#\s*->\s*(\S+)", line)
    return m.group(1) if m else None


def _check_shown(code: str, stdout: str, where: str):
    """Every `# -> TEXT` of a python block appears in its stdout, in the block's order."""
    pos = 0
    for line in code.splitlines():
        text = _shown(line)
        if text is not None:
            i = stdout.find(text, pos)
            assert i >= 0, (where, f"shows {text!r}", stdout)
            pos = i + len(text)


def _commands(code: str):
    """(argv, expected stdout text or None, background) per shell command."""
    for line in code.replace("\\\n", " ").splitlines():
        argv = shlex.split(line, comments=True)
        if argv:
            bg = argv[-1] == "&"
            yield (argv[:-1] if bg else argv), _shown(line), bg


def _wait_healthy(proc, port: int, timeout: float = 240):
    import httpx
    t = time.time()
    while time.time() - t < timeout:
        if proc.poll() is not None:
            pytest.fail(f"the README's server exited: {proc.stderr.read()}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    pytest.fail("the README's server did not start")


def _run_shell(block, port, servers):
    from dinfer_jax import cli
    for argv, expect, bg in _commands(_substitute(block["code"], port)):
        where = f"{block['page']}:{block['line']}: {' '.join(argv)}"
        if argv[0] == "dinfer-jax" and bg:
            p = subprocess.Popen([sys.executable, "-m", "dinfer_jax.cli"] + argv[1:], stdout=subprocess.DEVNULL,
                                 stderr=subprocess.PIPE, text=True)
            servers.append(p)
            _wait_healthy(p, port)
        elif argv[0] == "dinfer-jax":
            out, err, code = io.StringIO(), io.StringIO(), 0
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                try:
                    cli.main(argv[1:])
                except SystemExit as e:
                    code = e.code or 0
            assert code == 0, (where, err.getvalue())
            assert expect is None or expect in out.getvalue(), (where, expect, out.getvalue())
        elif argv[0] == "curl":
            r = subprocess.run(argv, capture_output=True, text=True, timeout=300)
            assert r.returncode == 0 and '"choices"' in r.stdout, (where, r.stdout, r.stderr)
        else:
            pytest.fail(f"{where}: not a command this test can run; mark the block <!-- not-run: reason -->")


_MODELS = {}


def _cached_load_model(a, model_dir):
    """The CLI's loader, keeping one Model per folder across in-process commands (so commands with
    equal settings share compiled programs); mesh / multi-host flags load afresh."""
    if getattr(a, "mesh", None) or getattr(a, "coordinator", None):
        return _REAL_LOAD(a, model_dir)
    if model_dir not in _MODELS:
        _MODELS[model_dir] = _REAL_LOAD(a, model_dir)
    return _MODELS[model_dir]


from dinfer_jax import cli as _cli  # noqa: E402
_REAL_LOAD = _cli._load_model


@pytest.mark.parametrize("unit", units(), ids=lambda u: f"{u[0]['page']}:{u[0]['line']}")
def test_readme_block_runs(unit, monkeypatch):
    monkeypatch.setattr(_cli, "_load_model", _cached_load_model)
    port, servers = _free_port(), []
    try:
        for block in unit:
            code = _substitute(block["code"], port)
            if block["lang"] in ("python", "py"):
                if "from openai import" in code:
                    pytest.importorskip("openai")
                out = io.StringIO()
                with contextlib.redirect_stdout(out):
                    exec(compile(code, f"{block['page']}:{block['line']}", "exec"), {"__name__": "__readme__"})
                _check_shown(code, out.getvalue(), f"{block['page']}:{block['line']}")
            else:
                if "curl " in code and not any(os.access(os.path.join(d, "curl"), os.X_OK)
                                               for d in os.environ.get("PATH", "").split(os.pathsep)):
                    pytest.skip("curl is not installed")
                _run_shell(block, port, servers)
    finally:
        for p in servers:
            p.terminate()
            p.wait(timeout=30)

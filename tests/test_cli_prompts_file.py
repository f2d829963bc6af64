"""`dinfer-jax generate --prompts-file` on the built-in demo model (in-process): plain text and JSONL
files, batches of --batch-size, one output line per prompt in file order, clear errors."""
from __future__ import annotations

import json

import pytest

from dinfer_jax import cli
from dinfer_jax.tasks import solve

PROMPTS = ["add 123+045=", "sort 5391=", "next abcdefgz="]


def run(capsys, *args):
    cli.main(["generate", *args])
    return capsys.readouterr()


def test_text_and_jsonl_files(tmp_path, capsys):
    text = tmp_path / "prompts.txt"
    text.write_text(f"{PROMPTS[0]}\n\n{PROMPTS[1]}\r\n{PROMPTS[2]}\n")  # a blank line, a CRLF ending
    r = run(capsys, "--prompts-file", str(text), "--batch-size", "2", "--json")
    rows = [json.loads(x) for x in r.out.splitlines()]
    assert [x["index"] for x in rows] == [0, 1, 2] and [x["line"] for x in rows] == [1, 3, 4]
    assert [x["prompt"] for x in rows] == PROMPTS
    assert [x["text"] for x in rows] == [solve(p) for p in PROMPTS]  # the demo model's answers: 0168, 1359, bcdefgha
    assert "3 prompts in 2 batch(es) of at most 2" in r.err

    jsonl = tmp_path / "prompts.jsonl"
    jsonl.write_text("".join(json.dumps({"prompt": p, "id": i}) + "\n" for i, p in enumerate(PROMPTS)))
    r = run(capsys, "--prompts-file", str(jsonl))  # one batch (default --batch-size 16), plain lines
    assert r.out.splitlines() == [solve(p) for p in PROMPTS]
    assert "in 1 batch(es)" in r.err


@pytest.mark.parametrize("content,extra,msg", [
    ('{"prompt": "add 1+2="}\nadd 3+4=\n', [], "line 2: not JSON"),
    ('{"text": "add 1+2="}\n', [], "line 1: expected {\"prompt\": \"text\"}"),
    ("\n\n", [], "has no prompts"),
    ("add 1+2=\nadd <|endoftext|>\n", [], "line 2 contains the special token"),
    ("add 1+2=\n", ["--show-canvas"], "--show-canvas works with one prompt"),
])
def test_prompts_file_errors(tmp_path, capsys, content, extra, msg):
    f = tmp_path / "p.txt"
    f.write_text(content)
    with pytest.raises(SystemExit) as e:
        run(capsys, "--prompts-file", str(f), *extra)
    err = capsys.readouterr().err
    assert e.value.code == 2 and msg in err and len(err.strip().splitlines()) == 1, err


def test_prompts_file_is_exclusive_with_prompt(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        run(capsys, "--prompts-file", str(tmp_path / "missing.txt"), "--prompt", "x")
    assert e.value.code == 2 and "not allowed with argument" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        run(capsys, "--prompts-file", str(tmp_path / "missing.txt"))
    assert "does not exist" in capsys.readouterr().err

"""`dinfer-jax chat` on the built-in demo model, stdin piped in-process: the chat template applied
to the history, /reset, answers streamed block by block equal to the engine's plain answers."""
from __future__ import annotations

import io
import re
import sys

import numpy as np
import pytest

from dinfer_jax import SamplingParams, cli, generate, load_model
from dinfer_jax.chat import ChatFormatter
from dinfer_jax.checkpoint import DEMO_MODEL_DIR
from dinfer_jax.tokenizer import load_tokenizer

# --ignore-eos: every answer fills both blocks, so each one streams in two pieces
FLAGS = ["--gen-length", "16", "--block-length", "8", "--ignore-eos"]


class Recorder(io.StringIO):
    """stdout that remembers every flushed piece."""

    def __init__(self):
        super().__init__()
        self.pieces, self._last = [], 0

    def flush(self):
        text = self.getvalue()
        if len(text) > self._last:
            self.pieces.append(text[self._last:])
            self._last = len(text)


def chat(monkeypatch, capsys, stdin: str, *flags) -> tuple[Recorder, str]:
    out = Recorder()
    monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    monkeypatch.setattr(sys, "stdout", out)
    cli.main(["chat", *flags])
    out.flush()
    return out, capsys.readouterr().err


def test_chat_history_reset_and_streaming(monkeypatch, capsys):
    stdin = "add 012+034=\n<|endoftext|>\n/rest\n\nsort 3142=\n/reset\nadd 012+034=\n"
    out, err = chat(monkeypatch, capsys, stdin, *FLAGS, "--show-prompt")
    # the special token in a message and the unknown command are refused; the session goes on
    assert "your message contains the special token '<|endoftext|>'" in err
    assert "unknown command /rest" in err and "[history cleared]" in err
    answers = out.getvalue().split("\n")
    assert len(answers) == 4 and answers[3] == "", answers  # three answers, each ending with a newline
    prompts = re.findall(r"\[prompt: \d+ tokens\]\n(.*?)\n\[/prompt\]", err, re.S)
    fmt = ChatFormatter(DEMO_MODEL_DIR, "llada_moe")
    u1, u2 = ({"role": "user", "content": c} for c in ("add 012+034=", "sort 3142="))
    a1 = {"role": "assistant", "content": answers[0]}
    assert prompts == [fmt([u1]), fmt([u1, a1, u2]), fmt([u1])]  # template, history, reset
    assert prompts[1].startswith("<role>HUMAN</role>add 012+034=<|role_end|><role>ASSISTANT</role>" + answers[0])

    # the engine's plain (non-streamed) answer to the same prompt (turn 3 repeats turn 1 after /reset)
    model, tok = load_model(DEMO_MODEL_DIR), load_tokenizer(DEMO_MODEL_DIR)
    sp = SamplingParams.for_model(model.config, DEMO_MODEL_DIR, gen_length=16, block_length=8, ignore_eos=True)
    ids = tok.encode_prompt(prompts[0], allow_special=True)
    plain = tok.decode(generate(model, [np.asarray(ids)], sp).token_ids[0])
    assert answers[0] == answers[2] == plain
    assert all(len(a) == 16 for a in answers[:3])  # --ignore-eos: no early stop, a character per token
    # streamed: the first block's text, then the second block's, then the newline (per answer)
    assert out.pieces == [p for a in answers[:3] for p in (a[:8], a[8:], "\n")], out.pieces


def test_chat_no_stream_exit_and_bad_model(monkeypatch, capsys, tmp_path):
    out, err = chat(monkeypatch, capsys, "add 012+034=\n/exit\nadd 1+1=\n", "--no-stream", *FLAGS,
                    "--system", "be brief", "--show-prompt")
    answer = out.getvalue()[:-1]
    assert len(answer) == 16 and out.pieces == [answer, "\n"]  # one answer, written whole; /exit quits
    assert "<role>SYSTEM</role>be brief<|role_end|><role>HUMAN</role>add 012+034=" in err
    assert "/exit or EOF quits" in err
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(SystemExit) as e:
        chat(monkeypatch, capsys, "", "--model", str(tmp_path))
    assert e.value.code == 2 and "chat needs" in capsys.readouterr().err

"""Chat templates and the tokenizer: the family formats from the reference, a folder's own
template (tokenizer_config.json or chat_template.jinja), and a BPE tokenizer trained here."""
from __future__ import annotations

import json

import pytest

from dinfer_jax.chat import ChatFormatter, ChatTemplateError, render

MSGS = [{"role": "system", "content": "detailed thinking off"}, {"role": "user", "content": " What is 2+2? "}]


@pytest.mark.smoke
def test_llada_moe_default_format():
    text = ChatFormatter(None, "llada_moe")(MSGS)
    assert text == ("<role>SYSTEM</role>detailed thinking off<|role_end|><role>HUMAN</role> What is 2+2? "
                    "<|role_end|><role>ASSISTANT</role>")


@pytest.mark.smoke
def test_llada_default_format_trims_and_starts_with_bos():
    text = ChatFormatter(None, "llada")(MSGS[1:])
    assert text == ("<|startoftext|><|start_header_id|>user<|end_header_id|>\n\nWhat is 2+2?<|eot_id|>"
                    "<|start_header_id|>assistant<|end_header_id|>\n\n")
    assert not ChatFormatter(None, "llada")(MSGS[1:], add_generation_prompt=False).endswith("\n\n")


@pytest.mark.smoke
def test_folder_template_wins(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": {"content": "<s>"}, "chat_template": "{{ bos_token }}{% for m in messages %}[{{ m.role }}]"
                                                            "{{ m.content }}{% endfor %}"}))
    assert ChatFormatter(str(tmp_path), "llada_moe")(MSGS[1:]) == "<s>[user] What is 2+2? "
    d = tmp_path / "jinja"
    d.mkdir()
    (d / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content | upper }}{% endfor %}")
    assert ChatFormatter(str(d), "llada")(MSGS[1:]) == " WHAT IS 2+2? "


@pytest.mark.smoke
@pytest.mark.parametrize("msgs,needle", [([], "non-empty"), ([{"role": "user"}], "'role' and 'content'"),
                                         ([{"role": "bot", "content": "x"}], "not one of"),
                                         ([{"role": "user", "content": 3}], "must be a string")])
def test_bad_messages(msgs, needle):
    with pytest.raises(ChatTemplateError, match=needle):
        ChatFormatter(None, "llada_moe")(msgs)


@pytest.mark.smoke
def test_template_errors_are_clear():
    with pytest.raises(ChatTemplateError, match="only user turns"):
        render("{{ raise_exception('only user turns') }}", MSGS)
    with pytest.raises(ChatTemplateError, match="failed to render"):
        render("{% for %}", MSGS)
    with pytest.raises(ChatTemplateError, match="none known for family"):
        ChatFormatter(None, "no-such-family")


@pytest.mark.smoke
def test_bpe_tokenizer_round_trip(tmp_path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from dinfer_jax.tokenizer import load_tokenizer
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    lines = ["masked diffusion decodes many tokens per step", "the whole schedule runs in one jit"]
    tok.train_from_iterator(lines * 3, trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>", "<unk>"],
                                                           initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(tmp_path / "tokenizer.json"))
    t = load_tokenizer(str(tmp_path))
    for text in lines + ["unseen wörds, too!"]:
        ids = t.encode(text)
        assert t.decode(ids) == text
    assert len(t.encode(lines[0])) < len(lines[0])  # merges were learned
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        load_tokenizer(str(tmp_path / "missing"))

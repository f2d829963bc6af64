"""Tokenizers: load a model folder's `tokenizer.json` (HF `tokenizers`), encode / decode;
`char_tokenizer()` builds the demo model's character-level tokenizer (docs/internals/runtime.md).
"""
from __future__ import annotations

import json
import os
import string

EOS_TOKEN = "<|endoftext|>"  # end of text; also the padding token
MASK_TOKEN = "<|mdm_mask|>"
UNK_TOKEN = "<|unk|>"
CHAR_SPECIALS = (EOS_TOKEN, MASK_TOKEN, UNK_TOKEN)  # ids 0, 1, 2 of the character tokenizer
CHARS = string.digits + string.ascii_lowercase + string.ascii_uppercase + string.punctuation + " \n\t"


class Tokenizer:
    """A thin wrapper over `tokenizers.Tokenizer`: ids never include added BOS/EOS."""

    def __init__(self, tok):
        self.tok = tok

    @classmethod
    def from_file(cls, path: str) -> "Tokenizer":
        from tokenizers import Tokenizer as HFTokenizer
        return cls(HFTokenizer.from_file(path))

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def encode_prompt(self, text, what: str = "prompt", allow_special: bool = False) -> list[int]:
        """Ids of user text, or a ValueError naming `what`: special tokens written in the text (e.g. a
        literal "<|endoftext|>", which would otherwise become the EOS id) unless `allow_special`
        (text made by a chat template), and characters the vocabulary lacks (which would silently
        become the unknown token)."""
        if not isinstance(text, str):
            raise ValueError(f"{what} must be text, got {type(text).__name__}")
        if not allow_special:
            found = sorted({t.content for t in self.tok.get_added_tokens_decoder().values()
                            if t.special and t.content and t.content in text})
            if found:
                raise ValueError(f"{what} contains the special token {found[0]!r} as text; special tokens cannot be "
                                 "written in a prompt (pass token ids instead, e.g. --prompt-ids)")
        enc = self.tok.encode(text, add_special_tokens=False)
        unk_token = getattr(self.tok.model, "unk_token", None)
        unk = self.tok.token_to_id(unk_token) if isinstance(unk_token, str) else None
        if unk is not None:
            bad = [text[a:b] for i, (a, b) in zip(enc.ids, enc.offsets) if i == unk and text[a:b] != unk_token]
            if bad:
                chars = ", ".join(repr(c) for c in dict.fromkeys(bad))
                raise ValueError(f"{what} has {len(bad)} character(s) the tokenizer does not know: {chars}")
        return enc.ids

    def encode_batch(self, texts) -> list[list[int]]:
        return [e.ids for e in self.tok.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.tok.token_to_id(token)

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size(with_added_tokens=True)

    def save(self, folder: str):
        """Write tokenizer.json (+ a minimal tokenizer_config.json naming the special tokens)."""
        os.makedirs(folder, exist_ok=True)
        self.tok.save(os.path.join(folder, "tokenizer.json"))
        specials = {t.content for t in self.tok.get_added_tokens_decoder().values()}
        cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False}
        for key, tok in (("eos_token", EOS_TOKEN), ("pad_token", EOS_TOKEN), ("mask_token", MASK_TOKEN),
                         ("unk_token", UNK_TOKEN)):
            if tok in specials:
                cfg[key] = tok
        with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
            json.dump(cfg, f, indent=1)


def has_tokenizer(folder: str) -> bool:
    return os.path.isfile(os.path.join(folder, "tokenizer.json"))


def load_tokenizer(folder: str) -> Tokenizer:
    """The tokenizer of a model folder (its tokenizer.json)."""
    path = os.path.join(folder, "tokenizer.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{folder}: no tokenizer.json")
    return Tokenizer.from_file(path)


def char_tokenizer(chars: str = CHARS) -> Tokenizer:
    """Character-level tokenizer: ids 0..2 = <|endoftext|>, <|mdm_mask|>, <|unk|>; then one id per char."""
    from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer
    if len(set(chars)) != len(chars):
        raise ValueError("char_tokenizer: duplicate characters")
    vocab = {t: i for i, t in enumerate(CHAR_SPECIALS)}
    for c in chars:
        vocab[c] = len(vocab)
    tok = HFTokenizer(models.WordLevel(vocab, unk_token=UNK_TOKEN))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in CHAR_SPECIALS])
    return Tokenizer(tok)

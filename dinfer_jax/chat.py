"""Chat templates: messages -> prompt text, as the model was trained. The model folder's own template
(tokenizer_config.json `chat_template` or chat_template.jinja) wins, rendered with jinja2 in a
sandbox; else the family's format. The text is tokenized without added special tokens
(docs/internals/runtime.md).
"""
from __future__ import annotations

import json
import os

ROLES = ("system", "user", "assistant")


class ChatTemplateError(ValueError):
    """Bad messages, or a template that fails to render."""


def _special(cfg: dict, key: str) -> str:
    v = cfg.get(key)
    if isinstance(v, dict):  # {"content": "<s>", ...}
        v = v.get("content")
    return v or ""


def load_template(folder: str | None, family: str) -> tuple[str, dict]:
    """(template source, special-token variables) for a model folder (None: the family default)."""
    tcfg = {}
    if folder:
        path = os.path.join(folder, "tokenizer_config.json")
        if os.path.isfile(path):
            with open(path) as f:
                tcfg = json.load(f)
    variables = {k: _special(tcfg, k) for k in ("bos_token", "eos_token", "pad_token", "unk_token", "mask_token")}
    tpl = tcfg.get("chat_template")
    if isinstance(tpl, list):
        named = {t.get("name"): t.get("template") for t in tpl if isinstance(t, dict)}
        tpl = named.get("default") or next(iter(named.values()), None)
    if not tpl and folder and os.path.isfile(os.path.join(folder, "chat_template.jinja")):
        with open(os.path.join(folder, "chat_template.jinja")) as f:
            tpl = f.read()
    if not tpl:
        from dinfer_jax import families
        fam = {f.name: f for f in families.all_families()}.get(family)
        if fam is None or not fam.chat_template:
            raise ChatTemplateError(f"no chat template in {folder!r} and none known for family {family!r}")
        tpl = fam.chat_template
        variables["bos_token"] = variables["bos_token"] or fam.bos_token
    return tpl, variables


def check_messages(messages) -> list[dict]:
    """[{"role": "system"|"user"|"assistant", "content": str}, ...] or ChatTemplateError."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ChatTemplateError("messages must be a non-empty list of {role, content}")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise ChatTemplateError(f"messages[{i}] must be an object with 'role' and 'content'")
        if m["role"] not in ROLES:
            raise ChatTemplateError(f"messages[{i}].role={m['role']!r} is not one of {ROLES}")
        content = m["content"]
        if isinstance(content, list):  # OpenAI content parts: only text parts are supported
            if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
                raise ChatTemplateError(f"messages[{i}].content: only text parts are supported")
            content = "".join(p.get("text", "") for p in content)
        if not isinstance(content, str):
            raise ChatTemplateError(f"messages[{i}].content must be a string")
        out.append({"role": m["role"], "content": content})
    return out


def render(template: str, messages, variables: dict | None = None, add_generation_prompt: bool = True) -> str:
    """Render a chat template (Hugging Face conventions) in a jinja2 sandbox."""
    from jinja2 import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(msg):
        raise ChatTemplateError(f"chat template: {msg}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    try:
        return env.from_string(template).render(messages=check_messages(messages),
                                                add_generation_prompt=add_generation_prompt,
                                                **(variables or {}))
    except TemplateError as e:
        raise ChatTemplateError(f"chat template failed to render: {e}") from None


class ChatFormatter:
    """messages -> prompt text for one model folder."""

    def __init__(self, folder: str | None, family: str):
        self.template, self.variables = load_template(folder, family)

    def __call__(self, messages, add_generation_prompt: bool = True) -> str:
        return render(self.template, messages, self.variables, add_generation_prompt)

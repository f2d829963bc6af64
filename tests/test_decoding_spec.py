"""decoding/spec.py's tables are the one source of the decoding options: every SamplingParams field
has a Setting, the CLI flags and the server's request fields are generated from them, and each
rule between fields blames a real field."""
import argparse
import dataclasses

import pytest

from dinfer_jax import cli
from dinfer_jax.decoding.spec import BOOL, CHOICE, INT, RULES, SETTINGS, InvalidParam, check_rules, flag_name
from dinfer_jax.engine import SamplingParams

pytestmark = pytest.mark.smoke
FIELDS = {f.name: f.default for f in dataclasses.fields(SamplingParams)}


def _other_value(name):
    """A valid value of the field other than its default."""
    s, d = SETTINGS[name], FIELDS[name]
    if s.kind == BOOL:
        return not d
    if s.kind == CHOICE:
        return next(c for c in s.choices if c != d)
    if s.kind == INT:
        return (s.low + 3) if d != s.low + 3 else s.low + 4
    return 0.5 if d != 0.5 else 0.25


def test_every_sampling_field_has_one_setting():
    assert set(SETTINGS) == set(FIELDS)
    assert {r.field for r in RULES} <= set(FIELDS)


def test_a_bad_value_is_refused_by_the_setting_and_names_the_field():
    for name, s in SETTINGS.items():
        bad = "nope" if s.kind != CHOICE else "not-a-choice"
        with pytest.raises(InvalidParam) as e:
            SamplingParams(**{name: bad})
        assert e.value.field == name
        if s.kind in (INT,) and s.low is not None:
            with pytest.raises(InvalidParam) as e:
                SamplingParams(**{name: int(s.low) - 1})
            assert e.value.field == name


def test_cli_flags_are_generated_from_the_settings():
    p = argparse.ArgumentParser()
    cli._add_decoding_flags(p)
    for name, s in SETTINGS.items():
        flag = flag_name(name)
        known = any(flag in a.option_strings for a in p._actions)
        assert known == s.cli, (name, flag)
        if not s.cli:
            continue
        v = _other_value(name)
        argv = [flag] if s.kind == BOOL else [flag, str(v)]
        assert cli._explicit_flags(p.parse_args(argv)) == {name: v}, name
    assert cli._explicit_flags(p.parse_args(["--edit-mode", "speed", "--threshold", "0.6"]))["threshold"] == 0.6


def test_server_fields_are_generated_from_the_settings():
    pytest.importorskip("pydantic")  # the [serve] extra (not in the python3.12 smoke environment)
    from dinfer_jax.serving.http import ChatRequest, CompletionRequest, DinferFields
    assert set(DinferFields.model_fields) == {n for n, s in SETTINGS.items() if s.server}
    for name, s in SETTINGS.items():
        if not s.server:
            continue
        v = _other_value(name)
        for req in (CompletionRequest(prompt="x", **{name: v}), ChatRequest(messages=[], **{name: v})):
            assert getattr(req, name) == v
        with pytest.raises(ValueError):  # strict types: "yes" is no number / boolean / choice
            CompletionRequest(prompt="x", **{name: "yes"})
    schema = CompletionRequest.model_json_schema()["properties"]  # the help reaches the OpenAPI schema
    assert all(schema[n].get("description") == s.help for n, s in SETTINGS.items() if s.server and s.help)


def test_each_rule_blames_its_own_field():
    """One SamplingParams per rule that breaks it (built without the construction check): the rules
    table answers with that rule's field."""
    cases = {
        "gen_length": dict(gen_length=12, block_length=8),
        "min_tokens": dict(gen_length=8, block_length=8, min_tokens=9),
        "smoothing": dict(smoothing=True, cache="prefix"),
        "eb_threshold": dict(eb_threshold=0.5),
        "sub_block_cache": dict(sub_block_cache=True),
        "alg": dict(alg="entropy"),
        "temperature": dict(cache="block", indel=True, temperature=1.0),
        "logprobs": dict(cache="block", indel=True, logprobs=5),
    }
    for field, kw in cases.items():
        with pytest.raises(InvalidParam) as e:
            check_rules(dataclasses.replace(SamplingParams(), **kw))
        assert e.value.field == field, (field, str(e.value))
    check_rules(SamplingParams())


def test_the_servers_fields_are_documented():
    import os
    doc = open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs",
                            "openai_fields.md")).read()
    missing = [n for n, s in SETTINGS.items() if s.server and n not in ("temperature", "seed", "top_p")
               and f"| `{n}` |" not in doc]
    assert not missing, f"docs/openai_fields.md lists no row for {missing}"


def test_a_choice_error_names_its_group():
    with pytest.raises(InvalidParam, match=r"\(Dream's sampler\)") as e:
        SamplingParams(gen_length=8, block_length=8, alg="bogus")
    assert e.value.field == "alg"


def test_a_hand_built_spec_refuses_what_its_loop_cannot_record():
    """DecodeSpec's own invariants hold without SamplingParams' rules: indel moves tokens after
    their logprob is recorded, so the spec itself refuses the pair."""
    from dinfer_jax.decoding.spec import DecodeSpec
    with pytest.raises(ValueError, match="logprobs does not combine with indel"):
        DecodeSpec(gen_length=8, block_length=8, cache="block", indel=True, editing=True, logprobs=0)
    DecodeSpec(gen_length=8, block_length=8, cache="block", indel=True, editing=True)

"""Canvas templates: infilling and structured output (dinfer_jax/structured.py and friends).

The guarantee is checked two ways: (1) rendering alone, on ids drawn at random from every slot
position's allowed set (thousands of canvases, a character tokenizer and a trained BPE one), each
output parsed and validated with `jsonschema` / matched with re.fullmatch; (2) through the jitted
loop on the demo models, hundreds of generated schemas under several strategies, caches and
temperatures: every output validates, every fixed position keeps its token and every slot
position holds a token of its set (the in-loop filter, not the renderer, kept it there).
"""
from __future__ import annotations

import json
import random
import re

import jsonschema
import numpy as np
import pytest

from dinfer_jax.canvas_template import infill_template
from dinfer_jax.checkpoint import DEMO_BLOCK_MODEL_DIR, DEMO_MODEL_DIR
from dinfer_jax.engine import InvalidParam, SamplingParams, generate
from dinfer_jax.json_template import SchemaError, json_schema_template
from dinfer_jax.regex_template import regex_template
from dinfer_jax.structured import Infill, StructuredOutput, build_constraint, generate_structured
from dinfer_jax.tasks import sample, solve
from dinfer_jax.token_classes import vocab_classes
from dinfer_jax.tokenizer import load_tokenizer

EOS, MASK = 0, 1  # the demo tokenizers' ids


# ---- generators

def random_schema(rng: random.Random, depth: int = 0) -> dict:
    kinds = ["integer", "number", "boolean", "null", "string", "enum", "const"]
    if depth < 2:
        kinds += ["object", "object", "array"]
    k = rng.choice(kinds)
    if k == "string":
        s = {"type": "string"}
        if rng.random() < 0.7:
            s["maxLength"] = rng.randint(1, 8)
        if rng.random() < 0.4:
            s["minLength"] = rng.randint(0, min(2, s.get("maxLength", 2)))
        return s
    if k == "enum":
        pool = ["red", "green", "a b", "x", 3, -1, 2.5, True, None, "é"]
        return {"enum": rng.sample(pool, rng.randint(1, 4))}
    if k == "const":
        return {"const": rng.choice(["on", 7, False, None])}
    if k == "object":
        props = {f"k{i}{rng.choice('abc')}": random_schema(rng, depth + 1) for i in range(rng.randint(0, 3))}
        s = {"type": "object", "properties": props}
        if props and rng.random() < 0.6:
            s["required"] = rng.sample(sorted(props), rng.randint(1, len(props)))
        if rng.random() < 0.3:
            s["additionalProperties"] = False
        return s
    if k == "array":
        lo = rng.randint(0, 2)
        return {"type": "array", "items": random_schema(rng, depth + 1), "minItems": lo,
                "maxItems": rng.randint(lo, 3)}
    return {"type": k}


def random_regex(rng: random.Random) -> str:
    atoms = []
    for _ in range(rng.randint(1, 5)):
        a = rng.choice([r"\d", r"\w", "[a-c]", "[^0-9 ]", "x", r"\.", "-", "[A-Z_]", "."])
        q = rng.choice(["", "", "?", "{2}", "{0,3}", "{1,2}"])
        atoms.append(a + q)
    return "".join(atoms)


def sample_ids(template, rng: random.Random, vocab_size: int, p_pad: float = 0.3) -> list[int]:
    """Ids a decoder could write: fixed tokens kept, each slot position a member of its set."""
    out = []
    for t, c in zip(template.tokens, template.classes):
        if c < 0:
            out.append(t)
        elif c == 0:
            out.append(rng.randrange(2, vocab_size))
        else:
            s = template.sets[c - 1]
            out.append(EOS if EOS in s and rng.random() < p_pad else rng.choice(s))
    return out


@pytest.fixture(scope="module")
def char_tok():
    return load_tokenizer(DEMO_MODEL_DIR)


@pytest.fixture(scope="module")
def bpe_tok(tmp_path_factory):
    """A small byte-level BPE tokenizer (multi-character tokens, merged digits) with the demo's
    special ids: EOS 0, mask 1."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>", "<|mdm_mask|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    text = ['{"name": "red green", "k0a": 123, "xs": [1.5, -20]}', "true false null 2024 007 é"] * 50
    tok.train_from_iterator(text, trainer)
    path = tmp_path_factory.mktemp("bpe") / "tokenizer.json"
    tok.save(str(path))
    from dinfer_jax.tokenizer import Tokenizer as Ours
    return Ours.from_file(str(path))


def _vocab(tok):
    n = tok.tok.get_vocab_size()
    return vocab_classes(tok, n, EOS, MASK), n


# ---- rendering alone: every canvas a decoder may write renders valid output

@pytest.mark.parametrize("which", ["char", "bpe"])
def test_every_sampled_canvas_renders_a_valid_json(which, char_tok, bpe_tok):
    tok = char_tok if which == "char" else bpe_tok
    vocab, V = _vocab(tok)
    rng = random.Random(7)
    n = 0
    for i in range(300):
        schema = random_schema(rng) if i else {"type": "object", "properties": {}}
        template, render = json_schema_template(schema, vocab, tok.encode, 4096)
        assert all(c >= 1 for c in template.classes if c >= 0), "JSON slots are always restricted"
        for p_pad in (0.0, 0.3, 1.0):
            text = render(sample_ids(template, rng, V, p_pad))
            jsonschema.validate(json.loads(text), schema)
            n += 1
    assert n == 900


@pytest.mark.parametrize("which", ["char", "bpe"])
def test_json_object_renders_an_object(which, char_tok, bpe_tok):
    tok = char_tok if which == "char" else bpe_tok
    vocab, V = _vocab(tok)
    rng = random.Random(3)
    template, render = json_schema_template(None, vocab, tok.encode, 4096)
    for p in (0.0, 0.5, 1.0):
        assert isinstance(json.loads(render(sample_ids(template, rng, V, p))), dict)


def test_every_sampled_canvas_matches_its_regex(char_tok):
    vocab, V = _vocab(char_tok)
    rng = random.Random(11)
    for _ in range(300):
        pattern = random_regex(rng)
        try:
            template, render = regex_template(pattern, vocab, 4096)
        except SchemaError as e:  # a pattern of fixed characters only
            assert "nothing to decode" in str(e)
            continue
        for p in (0.0, 0.5, 1.0):
            text = render(sample_ids(template, rng, V, p))
            assert re.fullmatch(pattern, text), (pattern, text)


@pytest.mark.parametrize("schema,keyword", [
    ({"type": "array", "items": {"type": "integer"}}, "maxItems"),
    ({"type": "array", "items": {"type": "integer"}, "maxItems": 1000}, "maxItems"),
    ({"$ref": "#/defs/x"}, "$ref"),
    ({"anyOf": [{"type": "integer"}, {"type": "string"}]}, "anyOf"),
    ({"type": "string", "pattern": "a+"}, "pattern"),
    ({"type": "integer", "minimum": 3}, "minimum"),
    ({"type": ["integer", "null"]}, "type"),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["b"]}, "required"),
    ({"type": "string", "minLength": 5, "maxLength": 3}, "minLength"),
    ({"type": "decimal"}, "type"),
    ({"type": "object", "properties": {"a": {"type": "string", "maxLength": 64}}}, "maxLength"),  # too long for 40
    ({"type": "array"}, "items"),
    ({"enum": []}, "enum"),
])
def test_schemas_the_template_cannot_express_name_the_keyword(schema, keyword, char_tok):
    vocab, _ = _vocab(char_tok)
    with pytest.raises(SchemaError) as e:
        json_schema_template(schema, vocab, char_tok.encode, 40)
    assert e.value.keyword == keyword


@pytest.mark.parametrize("pattern,what", [("a*", "'*'"), ("a+b", "'+'"), ("(ab){2}", "groups"), ("a|b", "alternation"),
                                          ("a{2,}", "{m,n}"), (r"\bx", r"\b"), ("[a-", "not closed"),
                                          ("abc", "nothing to decode")])
def test_regex_constructs_outside_the_subset_are_refused(pattern, what, char_tok):
    vocab, _ = _vocab(char_tok)
    with pytest.raises(SchemaError, match=re.escape(what)):
        regex_template(pattern, vocab, 4096)


# ---- through the loop

@pytest.fixture(scope="module")
def demo():
    from dinfer_jax import load_model
    return load_model(DEMO_MODEL_DIR), load_tokenizer(DEMO_MODEL_DIR)


@pytest.fixture(scope="module")
def demo_block():
    from dinfer_jax import load_model
    return load_model(DEMO_BLOCK_MODEL_DIR), load_tokenizer(DEMO_BLOCK_MODEL_DIR)


def _check_loop_kept_the_template(result, built):
    for ids, b in zip(result.token_ids, built):
        t = b.template
        assert len(ids) == len(t)
        for pos, (tok, fixed, c) in enumerate(zip(ids, t.tokens, t.classes)):
            if c < 0:
                assert tok == fixed, f"fixed position {pos} changed"
            elif c > 0:
                assert tok in t.sets[c - 1], f"slot position {pos}: {tok} outside its set"
            assert tok != MASK


CASES = [  # (model, SamplingParams overrides): strategies x caches x temperatures
    ("demo", dict(strategy="threshold", cache="dual")),
    ("demo", dict(strategy="factor", cache="none", temperature=0.8, seed=5)),
    ("demo", dict(strategy="threshold", cache="vicinity", temperature=1.0, seed=2)),
    ("demo", dict(strategy="credit", cache="prefix")),
    ("block", dict(cache="block")),
    ("block", dict(cache="block", editing_threshold=0.5, temperature=0.7, seed=9)),
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_generated_schemas_validate_through_the_loop(case, demo, demo_block):
    which, over = CASES[case]
    model, tok = demo if which == "demo" else demo_block
    rng = random.Random(100 + case)
    schemas = [random_schema(rng) for _ in range(40)]
    cons = [StructuredOutput(json=s) for s in schemas]
    p = SamplingParams.for_model(model.config, model.folder, **over)
    answers, result = generate_structured(model, tok, [tok.encode("add 12+34=")] * len(cons), cons, p,
                                          max_positions=512)
    built = [build_constraint(c, tok, model.config, 512) for c in cons]
    _check_loop_kept_the_template(result, built)
    for text, schema in zip(answers, schemas):
        jsonschema.validate(json.loads(text), schema)


def test_regex_and_choice_through_the_loop(demo):
    model, tok = demo
    rng = random.Random(5)
    patterns = []
    while len(patterns) < 24:
        pat = random_regex(rng)
        try:
            regex_template(pat, _vocab(tok)[0], 512)
            patterns.append(pat)
        except SchemaError:
            pass
    prompts = ["sort 5391=", "add 482+039="] + ["next abcdefgh="] * len(patterns)
    cons = ([StructuredOutput(choice=["9531", "1359", "zz"]), StructuredOutput(choice=["0521", "0522", "1"])]
            + [StructuredOutput(regex=p) for p in patterns])
    answers, result = generate_structured(model, tok, [tok.encode(p) for p in prompts], cons)
    assert answers[:2] == ["1359", "0521"]  # the demo model knows these answers
    _check_loop_kept_the_template(result, [build_constraint(c, tok, model.config, 512) for c in cons])
    for pat, text in zip(patterns, answers[2:]):
        assert re.fullmatch(pat, text), (pat, text)


@pytest.mark.parametrize("cache", ["none", "prefix", "dual", "vicinity"])
def test_infill_fills_the_middle_digits_of_a_sum(cache, demo):
    """add a+b= with the sum's 1st and 3rd digits given: the model fills the 2nd and 4th."""
    model, tok = demo
    prompts = [s["prompt"] for s in sample(16, seed=1, tasks=("add",))]
    sums = [solve(p) for p in prompts]
    templates = [infill_template([tok.encode(s[0]), 1, tok.encode(s[2]), 1]) for s in sums]
    p = SamplingParams.for_model(model.config, model.folder, cache=cache)
    r = generate(model, [tok.encode(x) for x in prompts], p, templates=templates)
    got = [tok.decode(ids) for ids in r.token_ids]
    right = sum(g == s for g, s in zip(got, sums))
    assert all(g[0] == s[0] and g[2] == s[2] for g, s in zip(got, sums))  # the given digits stay
    assert right >= 15, list(zip(got, sums))


def test_infill_with_a_suffix_on_the_block_model(demo_block):
    """A block-causal model: the suffix sits in the canvas (its own blocks see it; earlier blocks do
    not, by the model's attention); fixed positions keep their tokens; the span is cut at EOS."""
    model, tok = demo_block
    c = Infill(suffix="99", span=6)
    answers, r = generate_structured(model, tok, [tok.encode("sort 5391=")], [c])
    built = build_constraint(c, tok, model.config, 64)
    _check_loop_kept_the_template(r, [built])
    span = r.token_ids[0][:6]
    assert tok.decode(r.token_ids[0][6:]) == "99"
    assert answers[0] == tok.decode(span[:span.index(EOS)] if EOS in span else span)


def test_templates_are_checked(demo):
    model, tok = demo
    ids = [tok.encode("add 1+2=")]
    with pytest.raises(InvalidParam, match="1 templates for 2 prompts"):
        generate(model, ids * 2, templates=[infill_template([2])])
    with pytest.raises(InvalidParam, match="outside the vocabulary"):
        generate(model, ids, templates=[infill_template([[10 ** 6], 2])])
    with pytest.raises(InvalidParam, match="CanvasTemplate"):
        generate(model, ids, templates=["{}"])
    with pytest.raises(ValueError, match="at least one span"):
        infill_template([[3, 4]])


def test_an_unconstrained_row_beside_a_templated_one_decodes_as_alone(demo):
    """Rows without a template in a templated batch: free generation (no early stop there)."""
    model, tok = demo
    p = SamplingParams.for_model(model.config, model.folder)
    ids = [tok.encode("sort 5391="), tok.encode("add 123+045=")]
    alone = generate(model, ids[:1], p).token_ids[0]
    r = generate(model, ids, p, templates=[None, infill_template([tok.encode("0"), 3])])
    assert r.token_ids[0] == alone
    assert np.asarray(r.token_ids[1]).shape == (4,)


def test_infill_spans_fill_several_gaps(demo):
    """The region as pieces: "0" kept, 1 filled, "6" kept, 1 filled -> the whole sum; parts are the
    spans' texts; bad pieces are named."""
    model, tok = demo
    from dinfer_jax.structured import InfillSpans
    probs = sample(8, seed=3, tasks=("add",))
    cons = [InfillSpans((p["answer"][0], 1, p["answer"][2], 1)) for p in probs]
    answers, _ = generate_structured(model, tok, [tok.encode(p["prompt"]) for p in probs], cons)
    assert answers == [p["answer"] for p in probs]
    built = build_constraint(cons[0], tok, model.config, 64)
    ids = [int(t) for t in tok.encode(probs[0]["answer"])]
    assert built.parts(ids) == [probs[0]["answer"][1], probs[0]["answer"][3]]
    for bad, what in (((), "1..64 pieces"), (("a", 0), "infill[1]"), (("a",), "no span"), ((True, 2), "infill[0]")):
        with pytest.raises(SchemaError, match=re.escape(what)):
            build_constraint(InfillSpans(bad), tok, model.config, 64)


MORE = [  # the remaining strategies, fewer and shallower schemas (their steps are one token each)
    ("demo", dict(strategy="fixed", cache="dual")),
    ("demo", dict(strategy="random", cache="none", temperature=0.5, seed=4)),
    ("demo", dict(strategy="hierarchy", cache="dual")),
    ("block", dict(cache="block", strategy="sequential")),
    ("block", dict(cache="block", strategy="entropy_bounded", temperature=1.0, seed=1)),
    ("block", dict(cache="block", sub_block_length=2)),
]


@pytest.mark.parametrize("case", range(len(MORE)))
def test_more_strategies_keep_the_template(case, demo, demo_block):
    which, over = MORE[case]
    model, tok = demo if which == "demo" else demo_block
    rng = random.Random(300 + case)
    schemas = [random_schema(rng, depth=2) for _ in range(8)]
    cons = [StructuredOutput(json=s) for s in schemas] + [StructuredOutput(regex=r"[a-c]{1,3}\d")]
    p = SamplingParams.for_model(model.config, model.folder, **over)
    answers, result = generate_structured(model, tok, [tok.encode("sort 5391=")] * len(cons), cons, p,
                                          max_positions=512)
    _check_loop_kept_the_template(result, [build_constraint(c, tok, model.config, 512) for c in cons])
    for text, schema in zip(answers, schemas):
        jsonschema.validate(json.loads(text), schema)
    assert re.fullmatch(r"[a-c]{1,3}\d", answers[-1])


def test_cli_generate_with_templates(capsys):
    from dinfer_jax.cli import main
    for args, want in ((["--suffix", "68", "--span", "2"], "01"), (["--infill", '["0", 1, "6", 1]'], "0168"),
                       (["--regex", r"\d{4}"], "0168"), (["--choice", "0169", "--choice", "0168"], "0168")):
        main(["generate", "--prompt", "add 123+045=", *args])
        assert capsys.readouterr().out.strip() == want, args
    main(["generate", "--prompt", "add 1+2=", "--json-schema", '{"type": "object", "properties": {"a": {"enum": [1, 2]}}}',
          "--json"])
    assert json.loads(json.loads(capsys.readouterr().out)["text"])["a"] in (1, 2)
    with pytest.raises(SystemExit):
        main(["generate", "--prompt", "add 1+2=", "--regex", "a*"])
    assert "unbounded" in capsys.readouterr().err

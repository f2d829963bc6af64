"""Logit parity of dinfer-jax vs transformers references (fp32, CPU), through real HF folders.

  python bench/parity.py
Prints max |logit diff| / max |logit| and argmax agreement for LLaDA-MoE (vs Qwen3MoeForCausalLM)
and LLaDA dense (vs LlamaForCausalLM), both run bidirectionally (see tests/hf_reference.py).
"""
from __future__ import annotations

import json
import os
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))


def main():
    from conftest import DENSE_CFG, MOE_CFG
    from hf_reference import (bidirectional_logits, llada_moe_state_dict, llada_state_dict, llama_reference,
                              qwen3_moe_reference, write_hf_folder)
    from dinfer_jax import load_model
    rows = []
    for name, cfg, make, to_sd in (("llada_moe", MOE_CFG, qwen3_moe_reference, llada_moe_state_dict),
                                   ("llada", DENSE_CFG, llama_reference, llada_state_dict)):
        ref = make(cfg, seed=7)
        with tempfile.TemporaryDirectory() as d:
            write_hf_folder(d, cfg, to_sd(ref))
            model = load_model(d)
            ids = np.random.RandomState(0).randint(0, cfg.vocab_size, (4, 64))
            r, o = bidirectional_logits(ref, ids), model.logits(ids)
        rows.append({"family": name, "shape": list(ids.shape), "max_abs_diff": float(np.abs(r - o).max()),
                     "rel_diff": float(np.abs(r - o).max() / np.abs(r).max()),
                     "argmax_agree": float((r.argmax(-1) == o.argmax(-1)).mean())})
    for row in rows:
        print(json.dumps(row))


if __name__ == "__main__":
    main()

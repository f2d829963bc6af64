"""dInfer's fused-expert layout (`mlp.w1` (E, 2F, D), `mlp.w2` (E, D, F)) seen as the standard
per-expert names `mlp.experts.{e}.{gate,up,down}_proj.weight`, read one expert slab at a time
(docs/internals/converters.md).
"""
from __future__ import annotations

import re

from converters.errors import ConversionError
from converters.sources import TensorSource

_FUSED = re.compile(r"^(model\.layers\.\d+\.mlp\.)(w1|w2)$")
_VIRTUAL = re.compile(r"^(model\.layers\.\d+\.mlp\.)experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def has_fused_experts(source: TensorSource) -> bool:
    return any(_FUSED.match(k) for k in source.specs)


class FusedExpertsView(TensorSource):
    def __init__(self, source: TensorSource):
        self.source = source
        self.specs = {}
        for k, (shape, dt) in source.specs.items():
            m = _FUSED.match(k)
            if not m:
                self.specs[k] = (shape, dt)
                continue
            if len(shape) != 3:
                raise ConversionError(f"{k}: fused expert tensor must be 3-D (E, ., .), got shape {shape}")
            E = shape[0]
            if m.group(2) == "w1":
                if shape[1] % 2:
                    raise ConversionError(f"{k}: fused gate/up tensor has odd dim 1 ({shape}); expected (E, 2F, D)")
                F = shape[1] // 2
                for e in range(E):
                    self.specs[f"{m.group(1)}experts.{e}.gate_proj.weight"] = ((F, shape[2]), dt)
                    self.specs[f"{m.group(1)}experts.{e}.up_proj.weight"] = ((F, shape[2]), dt)
            else:
                for e in range(E):
                    self.specs[f"{m.group(1)}experts.{e}.down_proj.weight"] = ((shape[1], shape[2]), dt)
        self._slab_key, self._slab = None, None

    def read(self, name):
        m = _VIRTUAL.match(name)
        if not m or name in self.source.specs:
            return self.source.read(name)
        prefix, e, kind = m.group(1), int(m.group(2)), m.group(3)
        fused = prefix + ("w2" if kind == "down_proj" else "w1")
        if self._slab_key != (fused, e):
            self._slab_key, self._slab = (fused, e), self.source.read_slab(fused, e)
        if kind == "down_proj":
            return self._slab
        F = self._slab.shape[0] // 2
        return self._slab[:F] if kind == "gate_proj" else self._slab[F:]

    def close(self):
        self.source.close()

"""A live terminal view of diffusion decoding (`dinfer-jax generate --show-canvas`): one prompt's
generation region redrawn after every step, masks as '░', this step's decoded tokens green, edited
ones yellow. An observer for `Generator.generate(observer=...)` (docs/internals/runtime.md).
"""
from __future__ import annotations

import sys

MASK_GLYPH = "░"
_BOLD_GREEN, _BOLD_YELLOW, _DIM, _RESET = "\x1b[1;32m", "\x1b[1;33m", "\x1b[2m", "\x1b[0m"


class CanvasView:
    """Redraws row `row` of the canvas on `stream` (default stderr) after every step.

    decode(ids) -> str turns token ids into text (a tokenizer's decode; default: the ids).
    Enabled only when the stream is a TTY (or force=True); otherwise every call is a no-op.
    """

    def __init__(self, mask_id: int, stop_ids=(), decode=None, stream=None, row: int = 0, force: bool = False,
                 width: int = 100):
        self.mask_id, self.stop_ids = mask_id, set(stop_ids)
        self.decode = decode or (lambda ids: " ".join(map(str, ids)) + " ")
        self.stream = stream or sys.stderr
        self.row, self.width = row, width
        self.enabled = force or bool(getattr(self.stream, "isatty", lambda: False)())
        self._prev = None
        self._lines = 0
        self.steps = 0
        self.edits = 0  # filled tokens replaced by another token, over the whole generation

    def render(self, step: int, gen_G, done: bool) -> str:
        """One frame (without cursor movement): a status line, then the canvas text."""
        parts = []
        prev = self._prev
        edited = 0
        for i, t in enumerate(gen_G.tolist()):
            if t == self.mask_id:
                parts.append(MASK_GLYPH)
                continue
            text = "⏎" if t in self.stop_ids else self.decode([t])
            fresh = prev is not None and prev[i] == self.mask_id
            edit = prev is not None and prev[i] != self.mask_id and prev[i] != t
            edited += edit
            parts.append(f"{_BOLD_GREEN}{text}{_RESET}" if fresh else f"{_BOLD_YELLOW}{text}{_RESET}" if edit else
                         (f"{_DIM}{text}{_RESET}" if t in self.stop_ids else text))
        masked = int((gen_G == self.mask_id).sum())
        status = (f"step {step + 1:>4}  masked {masked:>4}/{len(gen_G)}" + (f"  edited {edited}" if edited else "")
                  + ("  done" if done else ""))
        body = "".join(parts)
        return status + "\n" + body

    def __call__(self, step, gen_BG, blk_B, done_B, active_B):
        self.steps = step + 1
        gen_G = gen_BG[self.row]
        if self._prev is not None:
            self.edits += int(((self._prev != self.mask_id) & (self._prev != gen_G)).sum())
        if not self.enabled:
            self._prev = gen_G.copy()
            return
        frame = self.render(step, gen_G, bool(done_B[self.row]))
        out = self.stream
        if self._lines:
            out.write(f"\x1b[{self._lines}F\x1b[J")  # back to the frame's first line, clear below
        out.write(frame + "\n")
        out.flush()
        self._lines = frame.count("\n") + 1 + _wrapped_extra(frame, self.width)
        self._prev = gen_G.copy()


def _wrapped_extra(frame: str, width: int) -> int:
    """Extra terminal lines taken by lines longer than the terminal width (approximate: counts
    visible characters, ignoring ANSI codes)."""
    import re
    extra = 0
    for line in frame.split("\n"):
        n = len(re.sub(r"\x1b\[[0-9;]*[A-Za-z]", "", line))
        extra += max(0, (n - 1) // max(1, width))
    return extra

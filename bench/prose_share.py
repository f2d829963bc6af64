"""The share of docstring lines in the project's code (issue 29: at most ~12% of non-blank lines).

  python bench/prose_share.py [--files N]   # total, then the N files with the most docstring lines

A docstring line is a non-blank line of a module / class / function docstring; comments are code.
"""
from __future__ import annotations

import argparse
import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("dinfer_jax", "pallas_kernels", "converters")


def count(path: str) -> tuple[int, int]:
    """(docstring lines, non-blank lines) of one file."""
    src = open(path).read()
    lines = src.split("\n")
    doc = 0
    for n in ast.walk(ast.parse(src)):
        if isinstance(n, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) \
                and ast.get_docstring(n, clean=False) is not None:
            e = n.body[0]
            doc += sum(1 for ln in lines[e.lineno - 1:e.end_lineno] if ln.strip())
    return doc, sum(1 for ln in lines if ln.strip())


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--files", type=int, default=0, help="list the files with the most docstring lines")
    a = ap.parse_args(argv)
    rows = []
    for pkg in PACKAGES:
        for d, _, files in os.walk(os.path.join(ROOT, pkg)):
            for f in sorted(files):
                if f.endswith(".py"):
                    p = os.path.join(d, f)
                    rows.append((*count(p), os.path.relpath(p, ROOT)))
    doc, total = sum(r[0] for r in rows), sum(r[1] for r in rows)
    print(f"docstring lines {doc} of {total} non-blank lines: {100 * doc / total:.1f}%")
    for d, n, p in sorted(rows, reverse=True)[:a.files]:
        print(f"{d:5d} {n:6d} {100 * d / max(n, 1):5.1f}% {p}")


if __name__ == "__main__":
    main()

"""No measured figure lives in a code comment or docstring: figures belong in
`benchmarks/RESULTS.md` (with machine, command and commit); a comment keeps only the reason.
Caught by shape: a timing with decimals, or a rate or bandwidth."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("runtime", "kernels", "operator", "bench", "benchmarks")
FIGURE = re.compile(r"\d+\.\d+ ?(?:ms|µs|us)\b"  # 4.69 ms
                    r"|(?<!default )\d[\d,.]* ?(?:tok/s|tokens/s|GB/s|TB/s|GiB/s|TFLOP/s|TFLOPS|MHz|req/s)"
                    r"|\d[\d.]* ?[x×] (?:faster|slower)")


def comments_and_docstrings(source: str) -> list[tuple[int, str]]:
    found = [(tok.start[0], tok.string) for tok in tokenize.generate_tokens(io.StringIO(source).readline)
             if tok.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Module | ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            docstring = ast.get_docstring(node, clean=False)
            if docstring:
                found.append((node.body[0].lineno, docstring))
    return found


def test_the_shape_of_a_figure_is_recognised() -> None:
    assert FIGURE.search("# the step takes 15.38 ms on an H200")
    assert FIGURE.search("reads at 3.98 TB/s") and FIGURE.search("30,881 tok/s") and FIGURE.search("1.8x faster")
    assert not FIGURE.search("# sleeps 1 ms at a time") and not FIGURE.search("(default 1 req/s)")


def test_no_measured_figure_in_a_comment_or_docstring() -> None:
    figures = [f"{path.relative_to(REPO)}:{line}: {match.group()!r}"
               for package in PACKAGES for path in sorted((REPO / package).rglob("*.py"))
               for line, text in comments_and_docstrings(path.read_text())
               for match in FIGURE.finditer(text)]
    assert figures == []

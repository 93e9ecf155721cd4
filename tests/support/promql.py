"""PromQL read by the tests: which metrics an expression selects."""

from __future__ import annotations

import promql_parser


def metric_names(expr: promql_parser.Expr) -> set[str]:
    """Every metric a parsed PromQL expression selects."""
    names: set[str] = set()

    def visit(node: promql_parser.Expr) -> bool:
        if isinstance(node, promql_parser.VectorSelector) and node.name:
            names.add(node.name)
        return True

    promql_parser.walk(expr, visit)
    return names

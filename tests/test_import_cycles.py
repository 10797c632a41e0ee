"""No import cycle among prefetch's modules, counting imports made only for type checking.

The layer contract in pyproject.toml (lint-imports) leaves ``if TYPE_CHECKING:`` imports out, so a
cycle through one passes it; this test counts them: a module that needs a type from a higher one
names the shape it needs as a Protocol instead (``prefetch.support.paths.ListedFile``)."""

from __future__ import annotations

from graphlib import CycleError, TopologicalSorter

import grimp


def test_no_module_imports_one_that_imports_it_back() -> None:
    graph = grimp.build_graph("prefetch", exclude_type_checking_imports=False)
    order: TopologicalSorter[str] = TopologicalSorter()
    for module in graph.modules:
        order.add(module, *graph.find_modules_directly_imported_by(module))
    try:
        order.prepare()
    except CycleError as exc:
        raise AssertionError(f"import cycle: {' -> '.join(exc.args[1])}") from None

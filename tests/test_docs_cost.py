"""docs/fleet-cost.md: the cost table is recomputed from the prices, parameters and formulas the
page states, so a changed price or formula that is not carried into the table fails here."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parent.parent / "docs" / "fleet-cost.md"
README = DOC.parent.parent / "README.md"
_UNITS = {"per GB": 1.0, "per hour": 1.0, "per GB-month": 1.0, "per 1,000 requests": 1e-3}
_SIZES = {"GB": 10**9, "MiB": 2**20}


def _text() -> str:
    return DOC.read_text(encoding="utf-8")


def _symbol_rows() -> dict[str, str]:
    """``symbol -> value cell`` from the tables whose second column is a `symbol`."""
    rows = re.findall(r"^\|[^|\n]*\| `(\w+)` \| ([^|\n]+) \|$", _text(), flags=re.MULTILINE)
    return {symbol: value.strip() for symbol, value in rows}


def _prices() -> dict[str, float]:
    prices = {}
    for symbol, cell in _symbol_rows().items():
        m = re.fullmatch(r"\$([\d.]+) (per .+)", cell)
        if m:
            prices[symbol] = float(m.group(1)) * _UNITS[m.group(2)]
    return prices


def _bytes(symbol: str) -> int:
    number, unit = _symbol_rows()[symbol].split()
    return int(float(number) * _SIZES[unit])


def _money(value: float) -> str:
    """Dollars as the page writes them: cents from $1, four decimals below."""
    return f"${value:,.2f}" if value >= 0.995 else f"${value:.4f}"


def _volume(n_bytes: int) -> str:
    """Bytes in GB or TB (10^9, 10^12) as the page writes them."""
    if n_bytes >= 10**12:
        return f"{n_bytes / 10**12:g} TB"
    return f"{n_bytes / 10**9:g} GB"


def _expected_row(nodes: int) -> list[str]:
    """One row of the table, from the page's formulas."""
    p = _prices()
    size, chunk, part = _bytes("S"), _bytes("c"), _bytes("u")
    gb = size / 10**9
    hub = nodes * gb * p["p_nat"]
    mirror = gb * p["p_nat"] + math.ceil(size / part) * p["p_put"]
    gets = nodes * math.ceil(size / chunk) * p["p_get"]
    storage = gb * p["p_store"]
    total = mirror + gets + storage
    return [
        str(nodes),
        _volume(nodes * size),
        _money(hub),
        _volume(size),
        _money(mirror),
        _money(gets),
        _money(storage),
        _money(total),
        f"{hub / total:.1f}x",
    ]


def _table_rows() -> dict[int, list[str]]:
    """The cost table's rows (those starting with a node count), by node count."""
    rows = {}
    for line in _text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| ") and cells[0].isdigit() and len(cells) == 9:
            rows[int(cells[0])] = cells
    return rows


def test_the_page_states_every_price_and_parameter_the_formulas_use() -> None:
    assert set(_prices()) == {"p_nat", "p_hour", "p_get", "p_put", "p_store"}
    assert {"S", "c", "u", "N"} <= set(_symbol_rows())
    assert re.search(r"as published on \*\*\d{4}-\d{2}-\d{2}\*\*", _text()), "prices need a date"


def test_the_table_has_the_node_counts_the_page_names() -> None:
    counts = [int(n) for n in _symbol_rows()["N"].split(", ")]
    assert sorted(_table_rows()) == counts == [1, 10, 100, 1000]


@pytest.mark.parametrize("nodes", [1, 10, 100, 1000])
def test_each_row_is_what_the_formulas_give(nodes: int) -> None:
    assert _table_rows()[nodes] == _expected_row(nodes)


def test_the_stated_counts_and_hourly_figure_follow_from_the_parameters() -> None:
    size, chunk, part = _bytes("S"), _bytes("c"), _bytes("u")
    text = _text()
    assert f"`ceil(S / u)` = {math.ceil(size / part):,} parts" in text
    assert f"`ceil(S / c)` = {math.ceil(size / chunk):,} GETs" in text
    assert f"= ${730 * _prices()['p_hour']:.2f} per AZ per month" in text


def test_the_readme_links_the_page() -> None:
    assert "docs/fleet-cost.md" in README.read_text(encoding="utf-8")

"""docs/roles.md's contracts table is generated from the facts files and stays so."""

from __future__ import annotations

import contractlib


def test_roles_doc_table_is_generated_from_the_facts() -> None:
    doc = contractlib.ROLES_DOC.read_text()
    expected = contractlib.doc_with_table(doc, contractlib.render_table(contractlib.load_facts()))
    assert doc == expected, (
        "docs/roles.md's contracts table differs from tests/contracts/facts/*.yaml: "
        "run `python tests/contracts/refresh.py --table`"
    )


def test_table_names_where_each_fact_was_checked() -> None:
    table = contractlib.render_table(contractlib.load_facts())
    for words in ("downloaded package", "recorded fixture", "documentation only"):
        assert f"| {words} |" in table

"""docs/reliability.md lists exactly the fault matrix the tests run."""

from __future__ import annotations

from reliability_doc import DOC, collect, rendered


def test_the_matrix_has_at_least_25_cases():
    assert len(collect()) >= 25


def test_the_document_matches_the_tests():
    doc = DOC.read_text()
    assert doc == rendered(doc), "docs/reliability.md is stale: run `python tests/reliability_doc.py --write`"

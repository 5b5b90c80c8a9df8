"""docs/protocol.md's message tables are the protocol module's, not a copy that drifts."""
from __future__ import annotations

import pathlib

from stella.protocol_docs import docs_with_tables

DOC = pathlib.Path(__file__).resolve().parent.parent / "docs" / "protocol.md"


def test_protocol_doc_tables_match_the_module():
    text = DOC.read_text()
    assert docs_with_tables(text) == text, "docs/protocol.md is stale: run `python -m stella.protocol_docs`"


def test_a_changed_table_is_detected():
    text = DOC.read_text()
    assert docs_with_tables(text.replace("| `worker` |", "| `wrkr` |", 1)) != text.replace("| `worker` |",
                                                                                         "| `wrkr` |", 1)

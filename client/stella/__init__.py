"""Stella: train one model across sites joined by slow links."""

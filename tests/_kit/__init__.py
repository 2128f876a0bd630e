"""The suite's shared kit: one runner for the installed commands (`cli`), and tiny models generated, split and
signed once per session (`models`, served to tests by the fixtures in tests/conftest.py).

Imported as `_kit` (tests/ is on sys.path through tests/conftest.py). Under pytest-xdist a session is one worker, so
a session-built model is built once per worker.
"""

"""Code the test modules share: checkpoint writers, hand-written configs, process checks, the
interpreter runner, the adversarial-case helpers and small spec builders. Not a test module:
pytest puts tests/ on sys.path (`pythonpath` in pyproject.toml), so these import as `helpers.x`."""

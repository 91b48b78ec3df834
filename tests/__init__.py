"""The test suite is a package: every folder in it is one, and a helper is imported by its
path from the checkout's root (``from tests.train.moldataset import make_dataset``,
``from tests.cli_exe import EXE``), which pytest puts on ``sys.path`` (``pythonpath`` in
pyproject.toml), as it does for ``bench`` (``from bench.lib.harness import Side``)."""

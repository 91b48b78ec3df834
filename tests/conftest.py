"""The suite's root: pytest puts this directory on ``sys.path`` (rootdir-relative imports),
so tests in any folder can use the helpers beside it (``from cli_exe import EXE``)."""

"""pytest setup. The Triton interpreter selection and its float fixes live in tests/__init__.py
and tests/triton_interpreter_patch.py, so that the matrix CLI and spawned ranks get them too."""

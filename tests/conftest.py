"""pytest setup. The Triton interpreter is chosen in tests/__init__.py (moe_modular/testing/triton_interpreter.py),
before any test module imports a kernel."""

"""The one class registry (moe_modular/registry.py): it lists every concrete PrepareAndFinalize and Experts class
of the package, the matrix runs exactly those, and the capabilities every PF answers (ABC defaults included)."""
from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest

import moe_modular.experts
import moe_modular.prepare_finalize
from moe_modular import registry
from moe_modular.interfaces import FusedMoEExpertsModular, FusedMoEPrepareAndFinalizeModular
from moe_modular.quant import QuantConfig
from moe_modular.testing.mk_objects import MK_ALL_PREPARE_FINALIZE_TYPES, MK_FUSED_EXPERT_TYPES


def _concrete(package, base) -> set[type]:
    found = set()
    for info in pkgutil.iter_modules(package.__path__):
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if issubclass(cls, base) and not inspect.isabstract(cls) and cls.__module__ == module.__name__:
                found.add(cls)
    return found


def test_registry_lists_every_concrete_class_once():
    pfs = _concrete(moe_modular.prepare_finalize, FusedMoEPrepareAndFinalizeModular)
    experts = _concrete(moe_modular.experts, FusedMoEExpertsModular)
    assert pfs and experts
    assert set(registry.PREPARE_FINALIZE_TYPES) == pfs and len(registry.PREPARE_FINALIZE_TYPES) == len(pfs)
    assert set(registry.EXPERTS_TYPES) == experts and len(registry.EXPERTS_TYPES) == len(experts)
    assert MK_ALL_PREPARE_FINALIZE_TYPES == list(registry.PREPARE_FINALIZE_TYPES)
    assert MK_FUSED_EXPERT_TYPES == list(registry.EXPERTS_TYPES)


def test_every_backend_pf_is_registered_under_its_backend():
    for cls in registry.PREPARE_FINALIZE_TYPES:
        backend = getattr(cls, "BACKEND", None)
        if backend:
            assert registry.prepare_finalize_type(backend) is cls


@pytest.mark.parametrize("name,replicated,fp8_block_on_the_wire", [
    ("MoEPrepareAndFinalizeNoEP", False, False),          # no dispatch
    ("BatchedPrepareAndFinalize", False, False),          # no dispatch
    ("AllToAllPrepareAndFinalize", False, True),
    ("SliceAllGatherPrepareAndFinalize", True, True),     # every rank passes the same tokens
    ("DeepEPLLPrepareAndFinalize", False, True),          # DeepEP's dispatch casts to 1 x 128 fp8
    ("SymmMemPrepareAndFinalize", False, True),
])
def test_pf_capabilities_are_methods_with_defaults(name, replicated, fp8_block_on_the_wire):
    cls = {c.__name__: c for c in registry.PREPARE_FINALIZE_TYPES}[name]
    assert cls.expects_replicated_input() is replicated
    assert cls.quantizes_before_dispatch(QuantConfig.fp8_block((128, 128))) is fp8_block_on_the_wire

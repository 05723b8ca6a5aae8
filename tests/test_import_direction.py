"""The project's import arrows, read from its own import statements (ast, nothing is imported).

    moe_modular -> all2all, and neither of them -> tests or tools; tools -> the packages, never tests;
    no import cycles among the modules of moe_modular and all2all.

Every import statement counts, module level or inside a function: a deferred import still ties
the two modules together.
"""
from __future__ import annotations

import ast
import os

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("moe_modular", "all2all", "tests", "tools")


def _module_name(path: str) -> str:
    rel = os.path.relpath(path, REPO)[:-3].split(os.sep)
    return ".".join(rel[:-1] if rel[-1] == "__init__" else rel)


def _modules() -> dict[str, str]:
    """{module name: file path} for every .py file of PACKAGES."""
    out = {}
    for pkg in PACKAGES:
        for root, _, files in os.walk(os.path.join(REPO, pkg)):
            for f in files:
                if f.endswith(".py"):
                    path = os.path.join(root, f)
                    out[_module_name(path)] = path
    return out


def _imports(name: str, path: str, known: set[str]) -> set[str]:
    """The project modules `name` imports (a `from a.b import c` names a.b.c where that is a module, else a.b)."""
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[: len(parts) - (node.level - 1)]
                base = ".".join(parts + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for t in targets:
            # the longest project module that t is or lies in
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t and t != name:
                found.add(t)
    return found


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    mods = _modules()
    known = set(mods)
    assert {"moe_modular", "all2all", "moe_modular.modular_kernel", "all2all.base"} <= known
    return {m: _imports(m, p, known) for m, p in mods.items()}


def _top(module: str) -> str:
    return module.split(".")[0]


def _edges(graph, src_pkg: str, dst_pkgs: tuple[str, ...]) -> list[str]:
    return sorted(f"{m} -> {d}" for m, ds in graph.items() if _top(m) == src_pkg for d in ds if _top(d) in dst_pkgs)


def test_the_reader_sees_the_known_arrows(graph):
    # The graph is not empty by accident: arrows that must exist are found.
    assert "all2all.base" in graph["moe_modular.prepare_finalize.ep_prepare_and_finalize"]
    assert "moe_modular.workspace" in graph["moe_modular.modular_kernel"]
    assert "all2all.buffers" in graph["all2all.base"]


@pytest.mark.parametrize("pkg", ["moe_modular", "all2all"])
def test_packages_import_neither_tests_nor_tools(graph, pkg):
    assert _edges(graph, pkg, ("tests", "tools")) == []


def test_tools_import_nothing_from_tests(graph):
    assert _edges(graph, "tools", ("tests",)) == []


def test_all2all_imports_nothing_from_moe_modular(graph):
    assert _edges(graph, "all2all", ("moe_modular",)) == []


def _cycles(graph, pkgs: tuple[str, ...]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), restricted to pkgs."""
    nodes = sorted(m for m in graph if _top(m) in pkgs)
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if _top(w) not in pkgs:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in nodes:
        if v not in index:
            visit(v)
    return out


def test_cycle_finder_finds_a_cycle():
    g = {"moe_modular.a": {"moe_modular.b"}, "moe_modular.b": {"moe_modular.a"}, "moe_modular.c": {"moe_modular.a"}}
    assert _cycles(g, ("moe_modular",)) == [["moe_modular.a", "moe_modular.b"]]


def test_no_import_cycles_in_the_packages(graph):
    # A package's __init__ importing its own submodules (which import the package) is not a cycle of concern.
    g = {m: {d for d in ds if not (d == m.rpartition(".")[0] and graph.get(d) and m in graph[d])}
         for m, ds in graph.items()}
    assert _cycles(g, ("moe_modular", "all2all")) == []


def test_oracle_and_torch_experts_need_no_triton(tmp_path):
    """The float32 oracle and the CPU path (NoEP PF + TorchExperts, fp8 block included) run with Triton absent."""
    import subprocess
    import sys

    script = tmp_path / "no_triton.py"
    script.write_text('''
import sys
sys.modules["triton"] = None  # any import of triton now fails
import torch
from moe_modular.config import MoEConfig
from moe_modular.experts.torch_experts import TorchExperts
from moe_modular.modular_kernel import FusedMoEModularKernel
from moe_modular.prepare_finalize.no_ep import MoEPrepareAndFinalizeNoEP
from moe_modular.quant import MoEQuantParams, QuantConfig, quantize_weights
from moe_modular.reference import moe_torch

q = QuantConfig.fp8_block((128, 128))
moe = MoEConfig(num_experts=4, topk=2, hidden_dim=128, intermediate_dim=128, dtype=torch.bfloat16, quant=q)
w1, s1 = quantize_weights(torch.randn(4, 256, 128) / 8, q)
w2, s2 = quantize_weights(torch.randn(4, 128, 128) / 8, q)
params = MoEQuantParams(q, s1, s2)
pf = MoEPrepareAndFinalizeNoEP.make(moe)
kernel = FusedMoEModularKernel(pf, TorchExperts.for_prepare_finalize(moe, params, pf))
x = torch.randn(5, 128, dtype=torch.bfloat16)
w, ids = torch.topk(torch.randn(5, 4).softmax(-1), 2)
out = kernel(x, w1, w2, w, ids.to(torch.int32)).float()
ref = moe_torch(x.float(), w1, w2, w, ids, quant=params)
assert "triton" not in {m.split(".")[0] for m in sys.modules if sys.modules[m] is not None}
print(float(((out - ref).norm() / ref.norm())))
''')
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert float(proc.stdout.strip()) < 3e-2


def test_importing_the_harness_chooses_no_interpreter():
    """moe_modular.testing sets nothing on import: each command line chooses Triton's interpreter in its main."""
    import subprocess
    import sys

    code = ("import os, moe_modular.testing.cli, moe_modular.testing.matrix, moe_modular.testing.parallel_utils; "
            "assert 'TRITON_INTERPRET' not in os.environ, os.environ['TRITON_INTERPRET']")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_the_installed_command_line_chooses_the_interpreter_itself(tmp_path):
    """`python -m moe_modular.testing.cli`, run outside the checkout with no TRITON_INTERPRET set: its main chooses
    Triton's interpreter on a machine without a GPU before a kernel is imported, so a Triton pair passes."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    done = subprocess.run([sys.executable, "-m", "moe_modular.testing.cli", "--pf-type", "MoEPrepareAndFinalizeNoEP",
                           "--experts-type", "TritonExperts", "-m", "3", "--topk", "2", "--dtype", "bfloat16"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "1 passed, 0 failed" in done.stdout

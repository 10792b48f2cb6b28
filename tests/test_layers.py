"""The import graph of shmcache/ and workers/ points only down: every module
has a layer (``LAYERS``, bottom-up), imports only from its own layer or below,
and no imports form a cycle. The two processes of ``shmcache serve`` stay
apart: its HTTP front and supervisor never import a worker process's modules
(``SEPARATE``).

What counts as an import: every ``import``/``from ... import`` of a shmcache
or workers module, relative or absolute, wherever it is, a function body included: a
lazy upward import is still an upward dependency (it only runs later). The
one kind left out is an import under ``if TYPE_CHECKING:``, which never runs.
Importing a module also runs its package's ``__init__``; that implicit edge
is not counted, only the statements written.

A new module must be placed in ``LAYERS`` (the test fails until it is). An
upward import that cannot be avoided goes in ``ALLOWED``, with the reason.

Each object owns its fields: no code in shmcache/, workers/ or tools/ reads
or writes another object's private attribute (``obj._x``, one leading underscore), except
inside the class that defines it (``other._id`` in ``SharedBlock.__eq__``).
A function that must change an object's fields is that object's method. An
access that cannot be avoided (another library's attribute) goes in
``PRIVATE_ALLOWED``, with the reason. The tools reach a manager's parts
through its documented seams (``mgr.pool``, ``mgr.internals``), never
``mgr._p``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import shmcache
import workers

ROOT = Path(shmcache.__file__).parent
WORKERS = Path(workers.__file__).parent
PACKAGES = ("shmcache", "workers")

# Bottom-up. "." is the package itself (shmcache/__init__.py); names are
# relative to it, "l2" being shmcache/l2/__init__.py, except those of the
# workers package, which are written whole.
LAYERS = [
    ("leaves: the package's errors, the compiled modules, the folders' own __init__",
     "errors _hot _mlxbuf system shm pool manager models system.platform_linux"),
    ("system/: the platform seam, the BLAS binding",
     "system.platform system.blas system.blas_elf system.blas_find system.blas_load"),
    ("shm/: the byte map, the C parameter table, leaf structures",
     "shm.layout shm.counters shm.hot_params_gen shm.loosemap shm.table_chains"),
    ("shm/: the segment file, the pool lock, the hot operations",
     "shm.segment shm.lock shm.hot_ops"),
    ("shm/: the shared structures",
     "shm.blocks shm.freelist shm.index shm.chunks shm.refs shm.claims shm.slots"),
    ("pool/: one mapped pool, recovery, reclaim, this process's holder, reserves, "
     "the read-only view",
     "pool.pool pool.recovery pool.reclaim pool.holder pool.reserve pool.inspect_pool"),
    ("manager/: the block ledger, K/V arena, live views",
     "manager.core manager.fastpath manager.kv manager.views"),
    ("manager/: the owners over the ledger, seed containers",
     "manager.tables manager.prefix manager.kv_ops manager.admin manager.seed_views"),
    ("manager/: the facade with the seed's API", "manager.paged_cache"),
    ("the package, models/ (mlx-lm caches over the pool, weights, model sources), l2/",
     ". models.mlx_lm models.weights models.demo_model models.gguf models.model_source "
     "l2 l2.client l2.codec l2.identity l2.store l2.tier"),
    ("messages: HTTP front <-> supervisor, supervisor <-> worker processes",
     "workers workers.protocol workers.wire"),
    ("a worker process (python -m workers.worker.main): its engine",
     "workers.worker workers.worker.engine workers.worker.sampling workers.worker.step_timing "
     "workers.worker.prefill_threads "
     "workers.worker.main"),
    ("the supervisor (in the shmcache serve process): the pool, the worker processes, routing",
     "workers.supervisor workers.supervisor.backend workers.supervisor.worker_procs"),
    ("the HTTP front of shmcache serve",
     "server server.api server.app server.generation server.http_errors server.metrics "
     "server.openai_types server.responses server.sample_text server.tool_calls "
     "server.validation"),
    ("shmcache serve: the front over the supervisor", "server.main"),
    ("the command", "cli doctor"),
]

# Compiled modules (shmcache/_native/): they import nothing from shmcache.
NATIVE = {"shmcache._hot", "shmcache._mlxbuf"}

# (importer, imported) -> why an upward import is unavoidable. None today.
ALLOWED: dict = {}

# (importers, imported): modules under the first prefix never import one under
# the second, whatever their layers. The front and the supervisor run in the
# shmcache serve process, the engine in each worker process: they share only
# the messages of workers.protocol and workers.wire.
SEPARATE = [("shmcache.server", "workers.worker"), ("workers.supervisor", "workers.worker")]


def _full(short: str) -> str:
    if short == "workers" or short.startswith("workers."):
        return short
    return "shmcache" if short == "." else f"shmcache.{short}"


LAYER = {_full(s): (i, label) for i, (label, names) in enumerate(LAYERS)
         for s in names.split()}


def python_modules() -> dict:
    """Dotted name -> path of every .py module under shmcache/ and workers/."""
    out = {}
    for root in (ROOT, WORKERS):
        for f in sorted(root.rglob("*.py")):
            parts = (root.name,) + f.relative_to(root).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = f
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports_of(source: str, name: str, is_package: bool, known) -> list:
    """``[(imported module, line)]`` of the shmcache and workers modules that module
    ``name`` imports, at any depth but under ``if TYPE_CHECKING:``.
    A name imported from a module (not a submodule) counts as that module."""
    pkg = name.split(".") if is_package else name.split(".")[:-1]
    found = []

    def targets(node) -> list:
        if isinstance(node, ast.Import):
            return [a.name for a in node.names]
        if node.level:
            base = ".".join(pkg[:len(pkg) - node.level + 1] + [node.module or ""]).rstrip(".")
        else:
            base = node.module or ""
        return [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base
                for a in node.names]

    class Visitor(ast.NodeVisitor):
        def visit_If(self, node: ast.If) -> None:
            if _is_type_checking(node.test):
                for n in node.orelse:
                    self.visit(n)
            else:
                self.generic_visit(node)

        def visit_Import(self, node) -> None:
            for t in targets(node):
                if t in PACKAGES or t.startswith(tuple(p + "." for p in PACKAGES)):
                    while t not in known and "." in t:
                        t = t.rsplit(".", 1)[0]    # a name of a module: that module
                    if t != name:
                        found.append((t, node.lineno))

        visit_ImportFrom = visit_Import

    Visitor().visit(ast.parse(source))
    return found


def import_graph() -> dict:
    """Module -> [(imported module, line)] for every module under shmcache/ and workers/."""
    mods = python_modules()
    known = set(mods) | NATIVE
    return {m: imports_of(f.read_text(), m, f.name == "__init__.py", known)
            for m, f in mods.items()}


def _where(m: str, line: int) -> str:
    return f"{python_modules()[m].relative_to(ROOT.parent)}:{line}"


def test_every_module_has_a_layer():
    mods = set(python_modules())
    missing = sorted(mods - set(LAYER))
    assert not missing, ("modules with no layer: place each in tests/test_layers.py's LAYERS "
                         f"(the lowest layer above everything it imports): {missing}")
    stale = sorted(set(LAYER) - mods - NATIVE)
    assert not stale, f"LAYERS names modules that do not exist: {stale}"


def test_imports_point_down():
    bad = []
    for m, edges in import_graph().items():
        for t, line in edges:
            (lm, name_m), (lt, name_t) = LAYER[m], LAYER[t]
            if lt > lm and (m, t) not in ALLOWED:
                bad.append(f"{_where(m, line)}: {m} (layer {lm}, {name_m}) imports {t} "
                           f"(layer {lt}, {name_t}), an upward import")
    assert not bad, "\n".join(bad)


def test_the_serve_process_never_imports_a_worker_process_module():
    bad = [f"{_where(m, line)}: {m} imports {t}"
           for m, edges in import_graph().items() for t, line in edges
           for src, dst in SEPARATE
           if (m == src or m.startswith(src + ".")) and (t == dst or t.startswith(dst + "."))]
    assert not bad, "\n".join(bad)


def test_no_import_cycle():
    graph = import_graph()
    state: dict = {}          # module -> 1 on the current path, 2 done
    path: list = []           # [(module, line of the import that led to the next)]

    def visit(m: str):
        state[m] = 1
        for t, line in graph.get(m, ()):
            path.append((m, line))
            if state.get(t) == 1:
                i = next(k for k, (n, _) in enumerate(path) if n == t)
                return " -> ".join(f"{n} ({_where(n, ln)})" for n, ln in path[i:]) + f" -> {t}"
            if t not in state:
                cycle = visit(t)
                if cycle:
                    return cycle
            path.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state:
            cycle = visit(m)
            assert cycle is None, f"import cycle: {cycle}"


def test_the_scanner_counts_lazy_imports_and_skips_type_checking():
    src = ("from typing import TYPE_CHECKING\n"
           "import numpy\n"
           "from ..shm import layout as L\n"
           "from ..errors import CapacityError\n"
           "from . import codec\n"
           "import shmcache.shm.refs\n"
           "if TYPE_CHECKING:\n"
           "    from ..manager.paged_cache import PagedCacheManager\n"
           "def f():\n"
           "    from ..pool.pool import Pool\n"
           "    from shmcache import _hot\n")
    known = {"shmcache", "shmcache.l2", "shmcache.l2.x", "shmcache.l2.codec", "shmcache.shm.layout",
             "shmcache.errors", "shmcache.shm.refs", "shmcache.manager.paged_cache", "shmcache.pool.pool",
             "shmcache._hot"}
    got = imports_of(src, "shmcache.l2.x", False, known)
    assert got == [("shmcache.shm.layout", 3), ("shmcache.errors", 4), ("shmcache.l2.codec", 5),
                   ("shmcache.shm.refs", 6), ("shmcache.pool.pool", 10), ("shmcache._hot", 11)]


# ============================================ private attributes stay in their class
# (path relative to the repository, the expression as ast.unparse writes it) -> why
PRIVATE_ALLOWED = {
    ("shmcache/system/blas_elf.py",
     "ctypes.CDLL(libpath, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)._handle"):
        "ctypes documents CDLL._handle as the library's system handle; there is no other name",
    ("shmcache/server/main.py", "backend.tokenizer._tokenizer"):
        "mlx-lm's TokenizerWrapper has no public setter for the chat template",
    ("shmcache/server/main.py", "backend.tokenizer._chat_template"):
        "mlx-lm's TokenizerWrapper caches the template it read; the cache is cleared to use ours",
    ("shmcache/manager/core.py", "b._id"):
        "BlockLedger.bids reads its own SharedBlock views' id in the batched calls' loop; the "
        "block_id property costs about 30 ns a block there (2 us of a 64-block free)",
    ("shmcache/shm/lock.py", "self._tlock._is_owned"):
        "threading.RLock has no public is-owned test; recording the owner on every hold "
        "costs about 35 ns a hold (5% of one)",
    ("tools/demo/__main__.py", "os._exit"):
        "os._exit is the standard library's documented exit without cleanup",
    ("tools/bench/profile_read_kv.py", "kvmod._native"):
        "the profile switches kv's compiled reader off to time the numpy path, as test_kv_read does",
    ("tools/bench/l2_measure.py", "tiers[1].store._r"):
        "the bandwidth bench times a bare MGET on the store's own fetch connection",
}


def _class_attributes(cls: ast.ClassDef) -> set:
    """The names a class defines or uses as its own: its methods and class
    attributes, ``self._x``/``cls._x``, and names set by string
    (``object.__setattr__(self, "_m", ...)``, ``__slots__``)."""
    names = set()
    for n in ast.walk(cls):
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(n.name)
        elif (isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
              and n.value.id in ("self", "cls")):
            names.add(n.attr)
        elif isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name):
            names.add(n.target.id)
        elif isinstance(n, ast.Assign):
            names.update(t.id for t in n.targets if isinstance(t, ast.Name))
        elif isinstance(n, ast.Constant) and isinstance(n.value, str):
            names.add(n.value)
    return names


def private_accesses(source: str) -> list:
    """``[(line, expression)]`` of each ``obj._x`` in ``source`` where ``obj``
    is not ``self``/``cls`` and no enclosing class has ``_x`` as its own."""
    found = []

    def visit(node, own: frozenset) -> None:
        if isinstance(node, ast.ClassDef):
            own = own | _class_attributes(node)
        if (isinstance(node, ast.Attribute) and node.attr.startswith("_")
                and not node.attr.startswith("__") and node.attr not in own
                and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))):
            found.append((node.lineno, ast.unparse(node)))
        for child in ast.iter_child_nodes(node):
            visit(child, own)

    visit(ast.parse(source), frozenset())
    return found


def tool_files() -> list:
    """Every .py file under tools/ (scripts, not layered modules)."""
    return sorted((ROOT.parent / "tools").rglob("*.py"))


def test_no_private_attribute_of_another_object():
    bad, used = [], set()
    files = list(python_modules().values()) + tool_files()
    assert any(f.name == "workload_driver.py" for f in files)     # tools/ is scanned
    for f in files:
        rel = str(f.relative_to(ROOT.parent))
        for line, expr in private_accesses(f.read_text()):
            if (rel, expr) in PRIVATE_ALLOWED:
                used.add((rel, expr))
            else:
                bad.append(f"{rel}:{line}: {expr}")
    assert not bad, ("private attributes of another object (make what is needed that "
                     "object's method or public attribute):\n" + "\n".join(bad))
    assert used == set(PRIVATE_ALLOWED), f"stale PRIVATE_ALLOWED: {set(PRIVATE_ALLOWED) - used}"


def test_the_private_access_scanner():
    src = ("class A:\n"
           "    def __init__(self):\n"
           "        self._x = 1\n"
           "        object.__setattr__(self, '_y', 2)\n"
           "    def __eq__(self, other):\n"
           "        return self._x == other._x and other._y\n"
           "    def peek(self, b):\n"
           "        return b._m._p\n"
           "def f(a, mod):\n"
           "    a._x = 2\n"
           "    return mod._helper(), a.__class__, a.x\n")
    assert private_accesses(src) == [(8, "b._m._p"), (8, "b._m"), (10, "a._x"),
                                     (11, "mod._helper")]

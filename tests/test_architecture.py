"""The package's shape, as the one-loop design states it (docs/architecture.md): no import cycle, no module
importing another module's private name, one chunk loop (`lmloss.plan`), at most three loss autograd
Functions (`lmloss.functions`), the rank agreement in its own module (`lmloss.agreement`). Read from the source
with `ast`, function-level imports included."""

from __future__ import annotations

import ast
from pathlib import Path

import lmloss

SRC = Path(lmloss.__file__).resolve().parent
#: autograd Functions that are collectives or stand-ins, not losses: each names what it is.
NOT_LOSSES = {
    "GatherRows",  # chunks: sequence-parallel gather of hidden rows (backward: reduce-scatter)
    "_GatherCP",  # cp: context-parallel gather
    "AllReduceSum",  # sequences: a differentiable SUM over a group (a sequence's sums under CP)
    "_CopyToTP",  # sft.parallel: Megatron's copy-to-tensor-parallel region
    "_ModelOutput",  # bench: stands in for an LM head in the in-place rows
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, ast.Module]:
    return {_module_name(p): ast.parse(p.read_text(), str(p)) for p in SRC.rglob("*.py")}


def _imports(name: str, tree: ast.Module, known: set[str]) -> list[tuple[str, str | None]]:
    """``(imported lmloss module, the name taken from it or None)`` for every import in the module."""
    out = []
    package = name if name in known and any(k.startswith(name + ".") for k in known) else name.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, None) for a in node.names if a.name.startswith("lmloss")]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            if not base.startswith("lmloss"):
                continue
            for a in node.names:
                sub = f"{base}.{a.name}"
                out.append((sub, None) if sub in known else (base, a.name))
    return out


def test_the_import_graph_has_no_cycle():
    modules = _modules()
    known = set(modules)
    graph = {m: {dep for dep, _ in _imports(m, t, known) if dep in known and dep != m} for m, t in modules.items()}
    # a package's __init__ importing its own submodules, and a submodule importing its package for a
    # name it defines, is how Python packages are built: drop the package -> submodule edges
    for m in graph:
        graph[m] = {d for d in graph[m] if not d.startswith(m + ".")}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(d) :] + [d]))
            if d not in state:
                visit(d)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)


def test_no_module_imports_another_modules_private_name():
    modules = _modules()
    known = set(modules)
    found = [
        f"{m} imports {name} from {dep}"
        for m, tree in modules.items()
        for dep, name in _imports(m, tree, known)
        if name is not None and name.startswith("_") and dep != m and not name.startswith("__")
    ]
    assert found == []


#: What the rank agreement is made of (docs/reliability.md): defined in `lmloss.agreement` and nowhere else.
AGREEMENT_NAMES = {
    "RankAgreementError", "RankAgreementTypeError", "HOST_FIELDS", "TENSOR_FIELDS", "LABEL_FIELDS", "agree_over_group",
    "gather_plan", "check_plan_tensors", "errors_raised_on_every_rank", "tensor_fingerprint", "tensor_stats",
    "describe_arguments", "rank_checks_enabled", "will_gather",
}  # fmt: skip


def _defined(tree: ast.Module) -> set[str]:
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    return names


def test_the_rank_agreement_lives_in_its_own_module_beside_the_tp_math():
    """`lmloss.agreement` defines the agreement (and imports no other lmloss module: every op may use it);
    `lmloss.vocab_parallel` holds the TP math and resolves its shard through it; every module takes the
    agreement's names from it."""
    modules = _modules()
    known = set(modules)
    assert _defined(modules["lmloss.agreement"]) >= AGREEMENT_NAMES
    assert [dep for dep, _ in _imports("lmloss.agreement", modules["lmloss.agreement"], known)] == []
    elsewhere = {m: names & AGREEMENT_NAMES for m, t in modules.items() if (names := _defined(t)) & AGREEMENT_NAMES}
    assert elsewhere == {"lmloss.agreement": AGREEMENT_NAMES}
    taken = {
        (m, name, dep) for m, t in modules.items() for dep, name in _imports(m, t, known) if name in AGREEMENT_NAMES
    }
    assert taken and all(dep == "lmloss.agreement" for _, _, dep in taken), sorted(taken)
    assert ("lmloss.vocab_parallel", "gather_plan", "lmloss.agreement") in taken


def test_plan_holds_the_only_chunk_loops():
    """Walking the chunks (``plan.chunks(n)``) happens in `lmloss.plan` only: every op is a source, an
    objective and a sink of its loops."""
    walkers = []
    for path in SRC.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "chunks":
                walkers.append(_module_name(path))
            # a hand-written walk: for s in range(0, n, chunk)
            walk = isinstance(node, ast.For) and isinstance(node.iter, ast.Call)
            ranged = walk and ast.unparse(node.iter.func) == "range" and len(node.iter.args) == 3
            if ranged and "chunk" in ast.unparse(node.iter.args[2]):
                walkers.append(_module_name(path))
    assert set(walkers) == {"lmloss.plan"}


def test_at_most_three_loss_functions():
    functions = {}
    for path in SRC.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and any(ast.unparse(b).endswith("autograd.Function") for b in node.bases):
                functions[node.name] = _module_name(path)
    losses = {name: module for name, module in functions.items() if name not in NOT_LOSSES}
    assert losses == {
        "PerTokenLoss": "lmloss.functions", "SummedLoss": "lmloss.functions",
        "InPlaceCrossEntropy": "lmloss.functions",
    }  # fmt: skip


def _options_table() -> tuple[list[str], list[list[str]]]:
    text = (SRC.parents[1] / "docs" / "architecture.md").read_text()
    lines = [ln for ln in text.split("## Ops × options", 1)[1].splitlines() if ln.startswith("|")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    rows = [[c.strip() for c in ln.strip("|").split("|")] for ln in lines[2:]]
    return header, rows


def test_the_ops_by_options_table_in_the_docs_is_what_the_signatures_take():
    """docs/architecture.md's table: a "yes" cell's arguments are in the op's signature, a "no" cell's are
    not and the cell says why."""
    import inspect

    header, rows = _options_table()
    assert header[0] == "op" and len(rows) == 9
    for row in rows:
        name = row[0].strip("`")
        op = lmloss
        for part in name.split("."):
            op = getattr(op, part)
        params = set(inspect.signature(op).parameters)
        for column, cell in zip(header[1:], row[1:]):
            names = {n.strip() for n in column.split("/")}
            if cell == "yes":
                assert names <= params, (name, column)
            else:
                assert cell.startswith("no: ") and len(cell) > 8, (name, column, cell)
                assert not names & params, (name, column)

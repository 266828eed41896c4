"""The torchrun runners that make the rank's device the default device
(tests/distributed/common.setup) draw with a CPU generator only into tensors
made on the CPU by name: under a CUDA default device, a tensor made without
`device=` lands on the GPU, and torch refuses a CPU generator there
("Expected a 'cuda' device type for generator but found 'cpu'"), which the
CPU runs of the same runners cannot show. Read from the runners' source."""
import ast
import os

RUNNERS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "distributed")
RANDOM = {"rand", "randn", "randint", "randperm", "normal", "bernoulli", "multinomial", "rand_like", "randn_like"}


def _cpu_generator(expr):
    """torch.Generator() with no device (optionally .manual_seed(...))."""
    if isinstance(expr, ast.Call) and isinstance(expr.func, ast.Attribute) and expr.func.attr == "manual_seed":
        expr = expr.func.value
    return (isinstance(expr, ast.Call) and isinstance(expr.func, ast.Attribute) and expr.func.attr == "Generator"
            and not expr.args and not expr.keywords)


def implicit_device_draws(source):
    """(line, call) of each random draw from a CPU generator that names no
    device, in functions of `source`."""
    hits = []
    tree = ast.parse(source)
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.Module)):
            continue
        cpu = {t.id for n in ast.walk(fn) if isinstance(n, ast.Assign) and _cpu_generator(n.value)
               for t in n.targets if isinstance(t, ast.Name)}
        for node in ast.walk(fn):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in RANDOM):
                continue
            kw = {k.arg: k.value for k in node.keywords}
            g = kw.get("generator")
            if g is None or "device" in kw:
                continue
            if _cpu_generator(g) or (isinstance(g, ast.Name) and g.id in cpu):
                hits.append((node.lineno, ast.unparse(node)))
    return sorted(set(hits))


def test_runners_with_a_default_device_draw_cpu_generators_on_the_cpu():
    bad = []
    for name in sorted(os.listdir(RUNNERS)):
        if not name.endswith(".py"):
            continue
        with open(os.path.join(RUNNERS, name)) as f:
            source = f.read()
        if "setup(" not in source:  # the default device stays the CPU
            continue
        bad += [f"{name}:{line}: {call}" for line, call in implicit_device_draws(source)]
    assert not bad, "a CPU generator drawing into the default device (name device='cpu'):\n" + "\n".join(bad)


def test_the_reader_finds_implicit_device_draws():
    source = """
def f(p, dev):
    g = torch.Generator().manual_seed(1)
    a = torch.randn(p.shape, generator=g)
    b = torch.randn(3, generator=torch.Generator(), dtype=torch.float64)
    c = torch.randn(3, generator=g, device="cpu")
    h = torch.Generator(dev).manual_seed(2)
    d = torch.randn(3, generator=h)
"""
    found = [line for line, _ in implicit_device_draws(source)]
    assert found == [4, 5]

"""The SGLang adapter uses only names that sglang 0.5.23 has: adapter -> manifest -> wheel, all by ``ast``.

``tests/data/sglang_0.5.23_api.json`` records, for the pinned release, the
Engine methods and parameter names, ServerArgs fields, SamplingParams fields,
load format, memory tags, result keys and finish types the adapter relies on.

1. Adapter -> manifest (always): parsing ``megarl/rollout/sglang.py`` finds
   every ``self.engine.<method>(...)`` call (keywords only, no positional
   arguments), the keys of ``_server_kwargs`` (Engine's keyword arguments) and
   ``_sampling_kwargs`` (a request's sampling dict), the string subscripts of
   ``parse_output`` and ``parse_experts`` (result keys), the finish types of ``_FINISH``, the
   ``MEMORY_TAGS`` and the import of the Engine class; each is in the manifest.
   The fake engine of test_rollout_sglang.py has every manifest method with
   those parameter names.
2. Manifest -> wheel (when the wheel is here: ``MEGARL_SGLANG_WHEEL`` or
   ``/tmp/sgl/sglang-0.5.23-*.whl``; skipped otherwise): the wheel's metadata
   says 0.5.23, and its Python source, parsed from the zip without importing
   anything, defines each entry under that name with those parameter names.

Not covered: behaviour (types, defaults, semantics) — a name that exists but
means something else passes; see megarl/rollout/sglang.py for what only a
run with SGLang installed verifies.
"""
import ast
import glob
import inspect
import json
import os
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MANIFEST = json.loads((ROOT / "tests/data/sglang_0.5.23_api.json").read_text())
ADAPTER = ast.parse((ROOT / "megarl/rollout/sglang.py").read_text())


def _function(tree, name):
    return next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == name)


def _dict_keys(node):
    return {k.value for d in ast.walk(node) if isinstance(d, ast.Dict) for k in d.keys if isinstance(k, ast.Constant)}


def _assigned(tree, name):
    return next(n.value for n in ast.walk(tree) if isinstance(n, ast.Assign)
                and any(isinstance(t, ast.Name) and t.id == name for t in n.targets))


def _engine_calls():
    """(method, keyword names) of every ``self.engine.<method>(...)`` call in the adapter."""
    calls = []
    for node in ast.walk(ADAPTER):
        f = getattr(node, "func", None)
        if isinstance(node, ast.Call) and isinstance(f, ast.Attribute) and isinstance(f.value, ast.Attribute) \
                and f.value.attr == "engine" and isinstance(f.value.value, ast.Name) and f.value.value.id == "self":
            assert not node.args, f"positional arguments to SGLang's {f.attr}: pass keywords (line {node.lineno})"
            calls.append((f.attr, {k.arg for k in node.keywords}))
    return calls


def test_adapter_uses_only_manifest_names():
    methods = MANIFEST["engine"]["methods"]
    calls = _engine_calls()
    assert {m for m, _ in calls} == set(methods) - {"__init__"}  # all used; the manifest has no extras
    for method, keywords in calls:
        assert keywords <= set(methods[method]), (method, keywords - set(methods[method]))
    server = _dict_keys(_function(ADAPTER, "_server_kwargs"))
    assert server == set(MANIFEST["server_args"]["fields"])
    assert _dict_keys(_function(ADAPTER, "_sampling_kwargs")) == set(MANIFEST["sampling_params"]["fields"])
    subscripts = {n.slice.value for f in ("parse_output", "parse_experts") for n in ast.walk(_function(ADAPTER, f))
                  if isinstance(n, ast.Subscript) and isinstance(getattr(n.slice, "value", None), str)}
    assert subscripts == set(MANIFEST["output_keys"]["keys"]) | set(MANIFEST["finish_reasons"]["keys"])
    assert _dict_keys(_assigned(ADAPTER, "_FINISH")) <= set(MANIFEST["finish_reasons"]["values"])
    tags = [c.value for c in _assigned(ADAPTER, "MEMORY_TAGS").elts]
    assert tags == list(MANIFEST["memory_tags"]["constants"].values())
    formats = {d.values[d.keys.index(k)].value for d in ast.walk(_function(ADAPTER, "_server_kwargs"))
               if isinstance(d, ast.Dict) for k in d.keys if k.value == "load_format"}
    assert formats <= set(MANIFEST["load_formats"]["values"])
    (imp,) = [n for n in ast.walk(_function(ADAPTER, "load_engine_class")) if isinstance(n, ast.ImportFrom)]
    assert (imp.module.replace(".", "/") + ".py", [a.name for a in imp.names]) == (
        MANIFEST["engine"]["file"], [MANIFEST["engine"]["class"]])
    assert _assigned(ADAPTER, "SGLANG_VERSION").value == MANIFEST["version"]
    (imp,) = [n for n in ast.walk(_function(ADAPTER, "load_tensor_wrapper")) if isinstance(n, ast.ImportFrom)]
    wrapper = MANIFEST["serialized_tensor"]
    assert (imp.module.replace(".", "/") + ".py", [a.name for a in imp.names]) == (wrapper["file"], [wrapper["class"]])
    calls = [n for n in ast.walk(_function(ADAPTER, "load_tensor_wrapper")) if isinstance(n, ast.Call)
             and getattr(n.func, "id", None) == wrapper["class"]]
    assert calls and all({k.arg for k in c.keywords} == set(wrapper["fields"]) for c in calls)


def test_fake_engine_has_the_manifest_signatures():
    from sglang_fake import FakeEngine

    for method, params in MANIFEST["engine"]["methods"].items():
        accepted = inspect.signature(getattr(FakeEngine, method)).parameters
        assert set(params) <= set(accepted), (method, set(params) - set(accepted))


# -- manifest -> wheel -----------------------------------------------------------


@pytest.fixture(scope="module")
def wheel():
    path = os.environ.get("MEGARL_SGLANG_WHEEL")
    if path and not os.path.isfile(path):
        pytest.fail(f"MEGARL_SGLANG_WHEEL={path} is not a file")
    path = path or next(iter(sorted(glob.glob("/tmp/sgl/sglang-0.5.23-*.whl"))), None)
    if not path:
        pytest.skip("no sglang 0.5.23 wheel here (pip download --no-deps -d /tmp/sgl sglang==0.5.23, "
                    "or set MEGARL_SGLANG_WHEEL)")
    with zipfile.ZipFile(path) as z:
        sources = {n: z.read(n).decode() for n in z.namelist() if n.endswith(".py") and n.startswith("sglang/")}
        metadata = next(z.read(n).decode() for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    return {"sources": sources, "metadata": metadata, "trees": {}}


def _tree(wheel, path):
    if path not in wheel["trees"]:
        assert path in wheel["sources"], f"{path} is not in the wheel"
        wheel["trees"][path] = ast.parse(wheel["sources"][path])
    return wheel["trees"][path]


def _class(tree, name):
    return next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == name)


def _fields(cls):
    return {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}


def _string_constants(tree):
    return {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)}


def test_wheel_is_the_pinned_release(wheel):
    assert f"\nVersion: {MANIFEST['version']}\n" in wheel["metadata"]


def test_engine_methods_exist_with_those_parameters(wheel):
    engine = _class(_tree(wheel, MANIFEST["engine"]["file"]), MANIFEST["engine"]["class"])
    defs = {n.name: n.args for n in engine.body if isinstance(n, ast.FunctionDef)}
    for method, params in MANIFEST["engine"]["methods"].items():
        assert method in defs, f"Engine.{method} not defined"
        a = defs[method]
        names = {x.arg for x in a.posonlyargs + a.args + a.kwonlyargs}
        assert set(params) <= names, (method, set(params) - names)
    assert defs["__init__"].kwarg is not None  # Engine(**kwargs) -> ServerArgs(**kwargs)


def test_server_args_and_sampling_fields_exist(wheel):
    folder = MANIFEST["server_args"]["dir"]
    fields = set()
    for path in (p for p in wheel["sources"] if p.startswith(folder)):
        fields |= {f for c in ast.walk(_tree(wheel, path)) if isinstance(c, ast.ClassDef) for f in _fields(c)}
    assert set(MANIFEST["server_args"]["fields"]) <= fields, set(MANIFEST["server_args"]["fields"]) - fields
    sp = MANIFEST["sampling_params"]
    assert set(sp["fields"]) <= _fields(_class(_tree(wheel, sp["file"]), sp["class"]))
    choices = _assigned(_tree(wheel, MANIFEST["load_formats"]["file"]), "LOAD_FORMAT_CHOICES")
    assert set(MANIFEST["load_formats"]["values"]) <= {c.value for c in choices.elts}


def test_serialized_tensor_class_exists(wheel):
    wrapper = MANIFEST["serialized_tensor"]
    assert set(wrapper["fields"]) <= _fields(_class(_tree(wheel, wrapper["file"]), wrapper["class"]))


def test_memory_tags_and_result_formats_exist(wheel):
    consts = _tree(wheel, MANIFEST["memory_tags"]["file"])
    for name, value in MANIFEST["memory_tags"]["constants"].items():
        assert _assigned(consts, name).value == value
    keys = _string_constants(_tree(wheel, MANIFEST["output_keys"]["file"]))
    assert set(MANIFEST["output_keys"]["keys"]) <= keys
    entry = MANIFEST["logprob_entries"]  # output_token_logprobs: (logprob, token id, text) tuples
    fn = next(n for n in ast.walk(_tree(wheel, entry["file"])) if isinstance(n, ast.FunctionDef)
              and n.name == entry["function"])
    built = [[e.id for e in t.elts[:2] if isinstance(e, ast.Name)] for t in ast.walk(fn) if isinstance(t, ast.Tuple)]
    assert entry["order"] in built
    batch = _tree(wheel, MANIFEST["finish_reasons"]["file"])
    types = {d.values[i].value for d in ast.walk(batch) if isinstance(d, ast.Dict)
             for i, k in enumerate(d.keys) if isinstance(k, ast.Constant) and k.value == "type"
             and isinstance(d.values[i], ast.Constant)}
    assert set(MANIFEST["finish_reasons"]["values"]) <= types

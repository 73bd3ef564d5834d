"""Which ``hpc`` and ``trainer`` a process imports, and how hpcx starts its own Python processes.

hpcx installs two top-level import names, ``hpc`` and ``trainer``; both are common names. Two things
could make a process import someone else's under them:

- the folder a job was submitted from: ``python -m X`` puts the current folder first on ``sys.path``,
  so a ``trainer.py`` or a ``hpc/`` beside the job spec would be imported instead of hpcx's. Every
  Python process hpcx starts (each task, the batch script's check after srun, the array tasks of
  ``hpcx data prepare --site``) is therefore ``python -c BOOT MODULE ARGS`` (``python_command``):
  ``BOOT`` drops the current folder from ``sys.path`` before anything is imported, then ``main``
  runs ``MODULE`` as ``-m`` would. ``hpcx-rank`` (the console script for torchrun and a plain srun)
  starts from its own folder, never the current one. A user model (``model.arch = "pkg.mod:fn"``)
  still imports from the current folder: ``submit_folder_last`` appends it to ``sys.path``, after
  hpcx's own, once ``hpc`` and ``trainer`` are imported.
- another package (the index has a PyTorch library named ``trainer``) or a folder on ``PYTHONPATH``:
  ``problem`` tells it from where the ``hpcx`` distribution says its packages are (its ``RECORD``
  for a wheel, ``direct_url.json`` for an editable install), without importing the foreign code;
  ``hpcx submit`` and every process ``main`` starts refuse in one line.

Imports nothing but ``os``, ``sys`` and the leaf ``hpc.core.boot`` at module level: ``BOOT`` runs it before a
task holds its signals (the container check imports what it reads when it runs).
"""

from __future__ import annotations

import os
import sys

from hpc.core.boot import BOOT, python_command  # noqa: F401  (re-exported: the kinds build commands with it)

NAMES = ("hpc", "trainer")
DISTRIBUTION = "hpcx"
def main() -> None:
    """``BOOT``'s second half (``sys.argv`` is ``["-c", MODULE, ARGS...]``): refuse foreign packages in
    one line (exit 2), then run ``MODULE`` as ``python -m MODULE ARGS`` would."""
    module = sys.argv.pop(1)
    found = problem() or _image_problem()
    if found:
        print(f"hpcx: {found}", file=sys.stderr, flush=True)
        sys.exit(2)
    import runpy  # lazy: boot

    runpy.run_module(module, run_name="__main__", alter_sys=True)


def _image_problem() -> str | None:
    """Inside a container (``HPCX_CONTAINER_IMAGE`` set by the step): what the image lacks for hpcx."""
    if not os.environ.get("HPCX_CONTAINER_IMAGE"):
        return None
    from hpc.core.container import inside_problem, versions_line  # lazy: boot (before the signals are held)
    from hpc.schedulers import first_on_node  # lazy: boot

    if first_on_node(os.environ):  # once per node: what this node's image holds
        print(f"hpcx: {versions_line(os.environ)}", file=sys.stderr, flush=True)
    return inside_problem(os.environ, gpus=bool(os.environ.get("CUDA_VISIBLE_DEVICES")))


def rank() -> None:
    """The ``hpcx-rank RUN_DIR`` console script: ``python -m trainer RUN_DIR`` for torchrun
    (``torchrun --no-python hpcx-rank RUN``) and a plain ``srun hpcx-rank RUN``."""
    sys.argv[1:1] = ["trainer"]
    main()


def submit_folder_last() -> None:
    """Put the current folder (where a job was submitted, where each task starts) at the end of
    ``sys.path``, for a user model (``trainer.models.user``): after hpcx's own packages. Called once
    ``hpc`` and ``trainer`` are imported, so that an editable install's finder (on ``sys.meta_path``,
    asked after every path entry) is not asked for them again with the folder on the path."""
    here = os.getcwd()
    if here not in sys.path:
        sys.path.append(here)


def check() -> None:
    """``problem`` as a ``UserError`` (``hpcx submit``, ``hpcx dryrun``)."""
    found = problem()
    if found:
        from hpc.core.errors import UserError  # lazy: boot

        raise UserError([found])


def problem(path: list[str] | None = None, hpc_dir: str | None = None) -> str | None:
    """Why ``hpc`` or ``trainer`` is not this distribution's, in one line; None when both are.

    ``path`` (default ``sys.path``) is where the ``hpcx`` distribution's metadata is looked for and
    ``trainer`` is found (not imported: no foreign code runs); ``hpc_dir`` (default: the ``hpc`` running
    this code) is where ``hpc`` resolves.
    """
    search = list(sys.path if path is None else path)
    hpc_found = hpc_dir or os.path.dirname(os.path.abspath(sys.modules["hpc"].__file__ or ""))
    found = {"hpc": hpc_found, "trainer": _located("trainer", search, imported=path is None)}
    own, files = _own(search, hpc_found)
    for name in NAMES:
        where = found[name]
        if where is None:
            return (f"`{name}` is not importable here (hpcx's own is {own[name]}): reinstall hpcx "
                    f"(`pip install --force-reinstall hpcx`)")
        if _real(where) != _real(own[name]):
            return (f"`{name}` resolves to {found[name]}, not to hpcx's own {own[name]} (another package installs "
                    f"a top-level `{name}`, or a folder on PYTHONPATH holds one): uninstall that package or take "
                    f"its folder off PYTHONPATH, or give hpcx a virtual environment of its own")
    for name in NAMES:
        extra = _not_listed(own[name], files.get(name))
        if extra:
            return (f"`{name}` at {own[name]} holds {extra}, which hpcx did not install ({_installer(search, name)}): "
                    f"uninstall that package, then `pip install --force-reinstall hpcx`, or give hpcx a virtual "
                    f"environment of its own")
    return None


def _located(name: str, search: list[str], imported: bool = True) -> str | None:
    """The folder of top-level package ``name`` as an import would find it (``imported``: the one already
    imported, if it is)."""
    module = sys.modules.get(name) if imported else None
    file = getattr(module, "__file__", None) if module is not None else None
    if file:
        return os.path.dirname(os.path.abspath(file))
    from importlib.machinery import PathFinder  # lazy: boot

    spec = PathFinder.find_spec(name, search)
    if spec is None:  # not on the path: an editable install's finder (on sys.meta_path) may map it
        import importlib.util  # lazy: boot

        spec = importlib.util.find_spec(name) if search == sys.path else None
    if spec is None:
        return None
    if spec.origin and spec.origin not in ("namespace", "built-in", "frozen"):
        return os.path.dirname(spec.origin) if spec.origin.endswith("__init__.py") else spec.origin
    return next(iter(spec.submodule_search_locations or []), None)


def _dist_info(search: list[str]) -> str | None:
    """The first ``hpcx-*.dist-info`` folder on ``search`` (as ``importlib.metadata`` would find it)."""
    prefix = DISTRIBUTION + "-"
    for entry in search:
        try:
            names = os.listdir(entry or ".")
        except OSError:
            continue
        for name in sorted(names):
            if name.startswith(prefix) and name.endswith(".dist-info"):
                return os.path.join(entry or ".", name)
    return None


def _own(search: list[str], hpc_dir: str) -> tuple[dict[str, str], dict[str, tuple[set[str], dict[str, int]]]]:
    """Where this distribution's ``hpc`` and ``trainer`` are; for a wheel, also the top-level entries
    its RECORD lists in each and the sizes of its ``__init__.py`` files (name -> (entries, sizes)).
    Without an ``hpcx`` distribution (a source tree on the path): beside the running ``hpc``."""
    info = _dist_info(search)
    if info is None:
        root = os.path.dirname(hpc_dir)
        return {name: os.path.join(root, name) for name in NAMES}, {}
    root = os.path.dirname(info)
    files: dict[str, tuple[set[str], dict[str, int]]] = {name: (set(), {}) for name in NAMES}
    try:
        with open(os.path.join(info, "RECORD"), encoding="utf-8") as f:
            for line in f:
                path, _, rest = line.strip().partition(",")
                top, _, below = path.partition("/")
                if top in files and below:
                    files[top][0].add(below.split("/")[0])
                    size = rest.rpartition(",")[2]
                    if size.isdigit():
                        files[top][1][below] = int(size)
    except OSError:
        pass
    if all(files[name][0] for name in NAMES):  # a wheel's files
        return {name: os.path.join(root, name) for name in NAMES}, files
    mapped = _editable_mapping(info)
    if mapped is not None:
        return mapped, {}
    return {name: os.path.join(root, name) for name in NAMES}, {}


def _editable_mapping(info: str) -> dict[str, str] | None:
    """Where an editable install maps ``hpc`` and ``trainer``: setuptools' finder module (imported at
    start-up by its ``.pth``; no file read), else the project folder of ``direct_url.json``; else None."""
    for module_name, module in list(sys.modules.items()):
        mapping = getattr(module, "MAPPING", None)
        if (module_name.startswith(f"__editable___{DISTRIBUTION}_") and module_name.endswith("_finder")
                and isinstance(mapping, dict) and all(isinstance(mapping.get(name), str) for name in NAMES)):
            return {name: mapping[name] for name in NAMES}
    project = _editable_root(info)
    return None if project is None else {name: os.path.join(project, name) for name in NAMES}


def _editable_root(info: str) -> str | None:
    """The project folder of an editable install (``direct_url.json``: ``dir_info.editable``), else None."""
    try:
        with open(os.path.join(info, "direct_url.json"), encoding="utf-8") as f:
            import json  # lazy: boot

            data = json.load(f)
    except (OSError, ValueError):
        return None
    url = data.get("url", "") if isinstance(data, dict) else ""
    editable = isinstance(data, dict) and isinstance(data.get("dir_info"), dict) and data["dir_info"].get("editable")
    if not editable or not url.startswith("file://"):
        return None
    from urllib.parse import unquote, urlparse  # lazy: boot

    return unquote(urlparse(url).path)


def _not_listed(folder: str, listed: tuple[set[str], dict[str, int]] | None) -> str | None:
    """A file in ``folder`` the wheel's RECORD does not list, or an ``__init__.py`` of another size
    (overwritten), as words; None when all is hpcx's (or there is no RECORD to tell)."""
    if not listed or not listed[0]:
        return None
    entries, sizes = listed
    try:
        names = sorted(os.listdir(folder))
    except OSError:
        return None
    for name in names:
        if name != "__pycache__" and name not in entries:
            return os.path.join(folder, name)
    init = os.path.join(folder, "__init__.py")
    if "__init__.py" in sizes:
        try:
            if os.path.getsize(init) != sizes["__init__.py"]:
                return f"{init} of another size than hpcx's (overwritten)"
        except OSError:
            pass
    return None


def _installer(search: list[str], name: str) -> str:
    """Which other distribution lists files under ``name/`` (only asked when refusing: importlib.metadata)."""
    from importlib import metadata  # lazy: boot

    for dist in metadata.distributions(path=search):
        if (dist.metadata["Name"] or "").lower() == DISTRIBUTION:
            continue
        if any(str(f).startswith(name + "/") for f in dist.files or ()):
            return f"distribution {dist.metadata['Name']} {dist.version} installed it"
    return "no installed distribution says it did"


def _real(path: str) -> str:
    return os.path.normcase(os.path.realpath(path))

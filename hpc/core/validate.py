"""Input policy: what a well-typed value may hold before it reaches a job script, a terminal or a job.

``hpc.core.config`` checks shapes and types; this module decides the rest, in one place: printable text and
its length, environment-variable names, credential-looking names and values, the bounds of numbers,
run roots and data files (a scheduler's own options are checked by its package, e.g.
``hpc.schedulers.slurm.options``). Every check returns one-line messages (``[]`` when the value is fine) naming the key and what was
expected; the callers prefix the file. Torch-free and cheap: it runs on login nodes.
"""

from __future__ import annotations

import keyword
import os
import re
import stat
import sys
import typing as tp
import unicodedata
from pathlib import Path

from hpc.core.errors import ConfigError

# ---------------------------------------------------------------------------------------------- bounds

INT32_MAX = 2**31 - 1  # default bound of integer fields: Slurm parses counts as C int, c10d ranks are int32
INT64_MAX = 2**63 - 1  # integers in model.kwargs (what torch takes as a size or an index)
FLOAT_MAX = 1e9  # default bound of float fields: GB, GB/s, µs, minutes, rates; keeps products finite
SEED_MAX = 2**32 - 1  # the trainer mixes the seed into torch.Generator seeds (< 2**64) with step and sample
TEXT_MAX = 1024  # Slurm refuses names, comments, partitions … longer than 1024 bytes
NAME_MAX = 128  # job.name: shown by squeue/sacct and part of the run folder's name
PATH_MAX = 4096  # Linux PATH_MAX
CONFIG_MAX_BYTES = 1 << 20  # a spec or site profile is a few KB; anything bigger is a mistake
MAX_DEPTH = 32  # nesting of TOML tables/arrays and JSON headers; deeper input is refused, never recursed

# ------------------------------------------------------------------------------------------------ text

_CHAR_NAMES = {"\n": "newline", "\r": "carriage return", "\x00": "NUL", "\x1b": "escape", "\t": "tab",
               "\b": "backspace", "\a": "bell", "\v": "vertical tab", "\f": "form feed", "\x7f": "delete"}
_LEGACY = ("\n", "\r", "\x00", "\x1b")  # named without a code point, as they always were


def char_label(ch: str) -> str:
    """'a backspace character (U+0008)', 'a U+2028 LINE SEPARATOR character' …"""
    code = f"U+{ord(ch):04X}"
    if ch in _LEGACY:
        name = _CHAR_NAMES[ch]
        return f"{'an' if name[0] in 'aeiou' else 'a'} {name} character"
    if ch in _CHAR_NAMES:
        return f"a {_CHAR_NAMES[ch]} character ({code})"
    name = unicodedata.name(ch, "")
    return f"a {code} {name} character" if name else f"a {code} control character"


def first_unprintable(text: str) -> str | None:
    """The first character a terminal or sbatch would act on: controls (C0, DEL, C1), format characters
    (bidi overrides, zero-width), line/paragraph separators, unassigned and private-use code points."""
    if text.isprintable():  # fast path, in C; the ordinary space counts as printable
        return None
    return next(ch for ch in text if not ch.isprintable())


def utf8_len(text: str) -> int:
    """Bytes of ``text`` in UTF-8: what Slurm and the kernel count (an emoji is 4)."""
    return len(text.encode("utf-8", "surrogatepass"))


def check_text(path: str, text: str, max_len: int = TEXT_MAX) -> list[str]:
    """Printable and bounded: every string that reaches a job script or a terminal. ``max_len`` counts
    bytes of UTF-8, as Slurm (names, comments, partitions …) and Linux (paths) do."""
    size = utf8_len(text) if len(text) * 4 > max_len else len(text)  # cheap while it cannot be too long
    if size > max_len:
        if size == len(text):
            return [f"`{path}` is {len(text)} characters long: expected at most {max_len}"]
        return [f"`{path}` is {size} bytes long in UTF-8 ({len(text)} characters): expected at most {max_len} bytes"]
    ch = first_unprintable(text)
    if ch is not None:
        return [f"`{path}` contains {char_label(ch)}, which is not allowed in values that reach the job script"]
    return []


def shown(text: str, limit: int = 80) -> str:
    """``text`` safe to print: unprintable characters escaped as in repr, long text cut."""
    out = "".join(ch if ch.isprintable() else repr(ch)[1:-1] for ch in text[:limit])
    return out + (f"… ({len(text)} characters)" if len(text) > limit else "")


def check_job_name(name: str) -> list[str]:
    """Slurm shows it and the run folder starts with it: not empty, not an option, not a hidden file."""
    if not name.strip():
        return [f"`job.name` = {name!r}: expected a name (letters, digits, `-_.`), not an empty one"]
    if name.startswith("-"):
        return [f"`job.name` = {shown(name)!r}: expected a name that does not start with `-` "
                "(the run folder would be read as an option)"]
    if name != name.strip():
        return [f"`job.name` = {shown(name)!r}: expected no leading or trailing spaces"]
    return []


def check_world(nodes: int, tasks_per_node: int) -> list[str]:
    """Ranks are 32-bit ints in torch.distributed (and Slurm task ids): the product must fit."""
    world = nodes * tasks_per_node
    if world > INT32_MAX:
        return [f"`job.nodes` × tasks per node = {nodes} × {tasks_per_node} = {world} ranks: expected at "
                f"most {INT32_MAX} (torch.distributed ranks are 32-bit)"]
    return []


def check_batch(global_batch: int, micro_batch: int, world: int, ranks: str = "") -> list[str]:
    """The global batch must split into whole micro batches on every rank (``ranks``: how the world is
    counted, e.g. '2 nodes × 4 tasks'; the number by default). The one check: resolve, the sampler, the
    planner's advice and scale prediction ask it."""
    per_step = world * micro_batch
    if global_batch % per_step:
        return [f"`train.global_batch` = {global_batch} is not divisible by ranks × micro_batch "
                f"= {ranks or world} × {micro_batch} = {per_step}"]
    return []


# ------------------------------------------------------------------------------------------ user code

# Never a model factory: the standard library and the interpreter's own modules (`os:system`,
# `builtins:exec`, `subprocess:run` would run in every task with the spec's kwargs).
NOT_MODEL_MODULES = frozenset(sys.stdlib_module_names) | {"__main__", "builtins"}


def _identifier_problem(part: str) -> str | None:
    if not part:
        return "an empty name"
    if not part.isidentifier():
        return f"{shown(part)!r}, which is not a Python identifier"
    if keyword.iskeyword(part):
        return f"{part!r}, a Python keyword"
    return None


def check_model_arch(arch: str) -> list[str]:
    """``model.arch`` = ``package.module:function``: dotted identifiers, one `:`, a function name, and a
    module of the user's, not of the standard library."""
    from hpc.core.models import FAMILIES  # lazy: startup

    label = f"`model.arch` = {shown(arch)!r}"
    expected = f"expected {', '.join(repr(name) for name in FAMILIES)} or 'package.module:function'"
    module, colon, function = arch.partition(":")
    if not colon or ":" in function:
        return [f"{label}: {expected} (one `:` between the module and the function)"]
    parts = [("the module path", p) for p in module.split(".")] + [("the function", function)]
    bad = next(((where, why) for where, p in parts if (why := _identifier_problem(p))), None)
    if bad:
        return [f"{label}: {bad[0]} holds {bad[1]}: {expected} (dotted Python identifiers)"]
    top = module.split(".")[0]
    if top in NOT_MODEL_MODULES:
        what = "the module each task starts with" if top == "__main__" else "Python's standard library"
        return [f"{label}: `{top}` is {what}, not a model factory: expected a function of your own package that "
                "returns an nn.Module"]
    return []


def check_model_kwargs(kwargs: tp.Mapping[str, tp.Any]) -> list[str]:
    """Top-level ``model.kwargs`` keys are passed as keyword arguments: identifiers, not keywords."""
    errors = []
    for key in kwargs:
        if first_unprintable(key) is not None or (key.isidentifier() and not keyword.iskeyword(key)):
            continue  # unprintable keys: the loader's message
        why = "empty" if not key else "a Python keyword" if keyword.iskeyword(key) else "not a Python identifier"
        errors.append(f"`model.kwargs` key {shown(key)!r} is {why}: the model function is called with each key "
                      "as a keyword argument")
    return errors


def check_model_blocks(path: str) -> list[str]:
    """``model.blocks``: an attribute path (``transformer.h``, ``layers.0.blocks``), or empty for `blocks`."""
    if not path:
        return []
    for part in path.split("."):
        why = None if part.isdigit() else _identifier_problem(part)
        if why:
            return [f"`model.blocks` = {shown(path)!r} holds {why}: expected an attribute path such as "
                    "`transformer.h` (names and indices joined by `.`)"]
    return []


# ------------------------------------------------------------------------------------------- env names

ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
# What a site's [nccl] table may set: the collective libraries and torch's own switches
# (PYTORCH_CUDA_ALLOC_CONF, TORCH_NCCL_*, GLOO_SOCKET_IFNAME …), never the loader or the shell.
NCCL_PREFIXES = ("NCCL_", "TORCH_", "PYTORCH_", "GLOO_", "UCX_", "FI_")


def check_env_name(path: str, name: str) -> list[str]:
    """A valid shell variable name: anything else would be spliced into the script's export lines."""
    if ENV_NAME.match(name):
        return []
    other = next((ch for ch in name if not ch.isascii() and ch.isprintable()), None)
    what = f" (`{other}` is U+{ord(other):04X} {unicodedata.name(other, '')}".rstrip() + ")" if other else ""
    return [f"`{path}`: variable name {shown(name)!r}{what}: expected letters, digits and underscores, "
            "not starting with a digit"]


# What Slurm, srun, submitit, torch.distributed's launchers and hpcx itself read to place and start each
# rank: a job's env.set may not change it, and env.passthrough cannot bring it (the launcher sets it).
# (Each scheduler's own prefixes, e.g. Slurm's, come from ``hpc.schedulers.ENV_OWNERS``.)
LAUNCHER_PREFIXES = {"SUBMITIT_": "submitit", "TORCHELASTIC_": "torchrun", "HPCX_": "hpcx"}
RENDEZVOUS_NAMES = frozenset({"WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                              "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT"})
DEVICE_NAMES = frozenset({"CUDA_VISIBLE_DEVICES", "GPU_DEVICE_ORDINAL", "ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES"})


def launcher_variable(name: str, owners: tp.Mapping[str, str] = {}) -> str | None:
    """Who sets ``name`` in every task ('Slurm', 'hpcx' …), or None for a variable a job may set.
    ``owners``: more prefixes and who owns them (the schedulers', ``hpc.schedulers.ENV_OWNERS``)."""
    owner = next((who for prefix, who in {**owners, **LAUNCHER_PREFIXES}.items() if name.startswith(prefix)), None)
    if owner is None and name in RENDEZVOUS_NAMES:
        owner = "the launcher (torch.distributed's rendezvous)"
    if owner is None and name in DEVICE_NAMES:
        owner = "Slurm and hpcx (each rank's GPU)"
    return owner


def check_env_names(set_names: tp.Iterable[str], passthrough: tp.Iterable[str],
                    owners: tp.Mapping[str, str] = {}) -> list[str]:
    """``env.set`` and ``env.passthrough`` names that the launcher owns (``launcher_variable``), or that
    are in both."""
    errors, passed = [], [n for n in passthrough if isinstance(n, str)]
    for name in set_names:
        if owner := launcher_variable(name, owners):
            errors.append(f"`env.set.{shown(name)}`: {shown(name)} is set or read by {owner} in every task: expected a "
                          "variable of your own")
        if name in passed:
            errors.append(f"`env.set.{shown(name)}`: {shown(name)} is also in `env.passthrough`: expected it in "
                          "one of the two (set gives every task this value; passthrough takes the shell's)")
    for name in passed:
        if owner := launcher_variable(name, owners):
            errors.append(f"`env.passthrough`: {shown(name)} is set or read by {owner} in every task, not taken from "
                          "your shell: expected a variable of your own")
    return errors


def check_nccl(table: dict[str, tp.Any]) -> list[str]:
    """A site's [nccl] table: valid names with a known prefix, nothing that looks like a credential."""
    errors = []
    for key, value in table.items():
        path = f"nccl.{shown(key)}"
        bad = check_env_name(path, key)
        if bad:
            errors += bad
        elif not key.startswith(NCCL_PREFIXES):
            named = ", ".join(p + "*" for p in NCCL_PREFIXES[:-1]) + f" or {NCCL_PREFIXES[-1]}*"
            errors.append(f"`{path}`: expected an {named} variable")
        elif looks_secret(key):
            errors.append(f"`{path}` looks like a secret: a site profile's [nccl] values are written into "
                          "every job script; export it in the submitting shell instead")
        elif isinstance(value, str) and (kind := secret_value_kind(value)):
            errors.append(f"`{path}` holds what looks like {kind}: a site profile's [nccl] values are "
                          "written into every job script")
        else:
            errors += check_pinned_env(path, key, value)
    return errors


def check_pinned_env(path: str, key: str, value: tp.Any) -> list[str]:
    """Values the trainer depends on: ``GLOO_SOCKET_IFNAME`` takes interface names only (gloo has no
    ``^`` exclusions: ``^lo,docker`` would name an interface called "^lo"). (``TORCH_NCCL_ASYNC_ERROR_HANDLING``
    is pinned to 3 by the trainer itself, which warns when it overrides another value.)"""
    if key == "GLOO_SOCKET_IFNAME" and (not str(value).strip() or str(value).lstrip().startswith("^")):
        return [f"`{path}` = {value!r}: expected interface names (e.g. 'eth0' or 'ib0,ib1'); gloo takes no "
                "'^' exclusions as NCCL_SOCKET_IFNAME does"]
    return []


# --------------------------------------------------------------------------------------------- secrets

# Words that make a name a credential wherever they stand (also glued: DB_PASSWD, APIKEY, MY_CREDENTIALS).
_SECRET_PARTS = ("SECRET", "PASSWORD", "PASSWD", "PASSPHRASE", "CREDENTIAL", "APIKEY", "ACCESSKEY",
                 "PRIVATEKEY", "AUTHTOKEN", "ACCESSTOKEN", "BEARER")
# Words that make a name a credential as its last word: HF_TOKEN2, GITHUB_PAT, MYSQL_PWD, CI_JOB_JWT_V2.
# (Not anywhere: pad_token_id, num_key_value_heads and SSH_AUTH_SOCK are not credentials.)
_SECRET_LAST = {"TOKEN", "KEY", "PAT", "JWT", "PEM", "PWD", "PASS", "DSN", "COOKIE", "AUTH", "CREDS", "OTP"}
# Pairs of adjacent words that are credentials anywhere in a name: AWS_ACCESS_KEY_ID, API_KEY_FILE.
_SECRET_PAIRS = {("API", "KEY"), ("ACCESS", "KEY"), ("PRIVATE", "KEY"), ("SECRET", "KEY"), ("SIGNING", "KEY"),
                 ("KEY", "ID"), ("ACCESS", "TOKEN"), ("AUTH", "TOKEN"), ("REFRESH", "TOKEN"),
                 ("SESSION", "TOKEN"), ("ID", "TOKEN"), ("CLIENT", "SECRET")}
# A URL to a database or broker usually carries its password: DATABASE_URL, REDIS_URL, MONGODB_URI.
_STORE_WORDS = {"DATABASE", "DB", "POSTGRES", "POSTGRESQL", "PG", "MYSQL", "MARIADB", "MONGO", "MONGODB",
                "REDIS", "AMQP", "RABBITMQ", "BROKER", "SQLALCHEMY", "JDBC"}
_NOT_SECRET = {"PWD"}  # the shell's working directory


def _words(name: str) -> list[str]:
    """HF_TOKEN2 -> [HF, TOKEN]; hfToken -> [HF, TOKEN]; CI_JOB_JWT_V2 -> [CI, JOB, JWT]."""
    spaced = re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", name)
    words = [re.sub(r"\d+$", "", w) for w in re.split(r"[^A-Za-z0-9]+", spaced.upper())]
    words = [w for w in words if w]
    while len(words) > 1 and re.fullmatch(r"V", words[-1]):  # a trailing version word (_V2)
        words.pop()
    return words


def looks_secret(name: str) -> bool:
    """True for names (environment variables, kwargs keys) that look like credentials."""
    if name.upper() in _NOT_SECRET:
        return False
    glued = re.sub(r"[^A-Z]", "", name.upper())
    if any(part in glued for part in _SECRET_PARTS):
        return True
    words = _words(name)
    if not words:
        return False
    if words[-1] in _SECRET_LAST or any(pair in _SECRET_PAIRS for pair in zip(words, words[1:])):
        return True
    return bool(_STORE_WORDS & set(words)) and bool({"URL", "URI", "DSN"} & set(words))


_SECRET_VALUES = [
    ("GitHub token", re.compile(r"\b(gh[pousr]_[A-Za-z0-9]{30,}|github_pat_[A-Za-z0-9_]{30,})")),
    ("GitLab token", re.compile(r"\bglpat-[A-Za-z0-9_-]{20,}")),
    ("Hugging Face token", re.compile(r"\bhf_[A-Za-z0-9]{30,}")),
    ("AWS access key", re.compile(r"\b(AKIA|ASIA)[0-9A-Z]{16}\b")),
    ("Slack token", re.compile(r"\bxox[abprs]-[A-Za-z0-9-]{10,}")),
    ("API key", re.compile(r"\bsk-[A-Za-z0-9_-]{20,}")),
    ("JSON web token", re.compile(r"\beyJ[A-Za-z0-9_-]{8,}\.eyJ[A-Za-z0-9_-]{8,}\.")),
    ("private key", re.compile(r"-----BEGIN [A-Z ]*PRIVATE KEY")),
    ("URL with a password", re.compile(r"\b[a-zA-Z][a-zA-Z0-9+.-]*://[^/\s:@]+:[^/\s@]+@")),
]


def secret_value_kind(value: str) -> str | None:
    """'a GitHub token', 'an AWS access key' … when a value has the shape of a credential."""
    kind = next((kind for kind, pattern in _SECRET_VALUES if pattern.search(value)), None)
    return kind and f"{'an' if kind[0] in 'AEIOU' else 'a'} {kind}"


def hides_value(path: str) -> bool:
    """Whether a message about ``path`` (``env.set.HF_TOKEN``) must not print its value."""
    return any(looks_secret(part) for part in re.split(r"[.\[\]]", path) if part)


def unset_passthrough(names: tp.Sequence[str], environ: tp.Mapping[str, str] = os.environ) -> list[str]:
    """``env.passthrough`` names the submitting shell does not set: the job will not see them."""
    return [name for name in names if name not in environ]


# ----------------------------------------------------------------------------------------------- paths

_VAR = re.compile(r"\$(?:\{([^}]*)\}|([A-Za-z_][A-Za-z0-9_]*))")


def expand_path(value: str, where: str) -> Path:
    """``~`` and ``$VAR``/``${VAR}`` expanded, absolute and safe for Slurm's log paths.

    ``where`` names the file and key for the message (``FILE: `storage.run_root` = '…'``).
    Raises ConfigError for an unset variable, an unknown ``~user`` or a relative result.
    """
    missing = [m.group(1) if m.group(1) is not None else m.group(2) for m in _VAR.finditer(value)
               if (m.group(1) if m.group(1) is not None else m.group(2)) not in os.environ]
    if missing:
        raise ConfigError([f"{where}: ${missing[0]} is not set in this shell: set it, or write the path out"])
    text = os.path.expanduser(_VAR.sub(lambda m: os.environ[m.group(1) or m.group(2)], value))
    if not os.path.isabs(text):
        raise ConfigError([f"{where}: expands to {shown(text)!r}: expected an absolute path"])
    bad = first_unprintable(text)
    if bad is not None or utf8_len(text) > PATH_MAX:
        what = f"{char_label(bad)}" if bad is not None else f"{utf8_len(text)} bytes"
        raise ConfigError([f"{where}: expands to a path with {what}: expected at most {PATH_MAX} "
                           + ("printable characters" if bad is not None else "bytes")])
    return Path(os.path.normpath(text))


# ------------------------------------------------------------------------------------------------ data

SAMPLE_BLOCKS, SAMPLE_BLOCK_BYTES = 64, 64 * 1024  # at most 4 MiB read to find the largest token id


def largest_token(f: tp.BinaryIO, size: int, width: int) -> tuple[int, int]:
    """(largest token id, its byte offset) over 64 blocks of 64 KiB spread evenly from the first
    byte to the last: the whole file up to 4 MiB."""
    block = SAMPLE_BLOCK_BYTES
    if size <= SAMPLE_BLOCKS * block:
        starts = list(range(0, size, block))
    else:
        span = size - block
        starts = sorted({(k * span // (SAMPLE_BLOCKS - 1)) // width * width for k in range(SAMPLE_BLOCKS)})
    best, where = -1, 0
    for start in starts:
        f.seek(start)
        data = f.read(block)
        tokens = memoryview(data[:len(data) - len(data) % width]).cast("H" if width == 2 else "I")
        top = max(tokens, default=-1)
        if top > best:
            best, where = top, start + width * tokens.tolist().index(top)
    return best, where


def file_kind(mode: int) -> str:
    """'a directory', 'a FIFO' … for a message about a file that is not a regular one."""
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"


def open_regular(path: str | os.PathLike, label: str, expected: str = "a regular file",
                 error: type[ConfigError] | type = ConfigError) -> tp.BinaryIO:
    """``path`` opened for reading once it is known to be a regular file (after symlinks): a FIFO,
    a device or a socket is refused before it is opened (opening a FIFO blocks, reading /dev/zero never
    ends). ``label`` starts the one-line ``error``, which ends with ``expected``."""
    try:
        mode = os.stat(path).st_mode
        if not stat.S_ISREG(mode):
            raise error([f"{label}: {file_kind(mode)}: expected {expected}"])
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        raise error([f"{label}: no such file: expected {expected}"]) from None
    except OSError as exc:
        raise error([f"{label}: cannot open ({exc.strerror}): expected {expected}"]) from None
    info = os.fstat(fd)  # the path may have been replaced since the stat
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        raise error([f"{label}: {file_kind(info.st_mode)}: expected {expected}"])
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb")


def check_regular(path: str | os.PathLike, label: str, expected: str = "a regular file",
                  error: type[ConfigError] | type = ConfigError) -> int:
    """The size of ``path`` once it is known to be a regular file (``open_regular``'s refusals), unopened."""
    try:
        info = os.stat(path)
    except FileNotFoundError:
        raise error([f"{label}: no such file: expected {expected}"]) from None
    except OSError as exc:
        raise error([f"{label}: cannot read ({exc.strerror}): expected {expected}"]) from None
    if not stat.S_ISREG(info.st_mode):
        raise error([f"{label}: {file_kind(info.st_mode)}: expected {expected}"])
    return info.st_size

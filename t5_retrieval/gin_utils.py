"""t5x-style gin configuration shared by every subcommand: gin files, `--gin.NAME=value` bindings and
search paths, parsed and checked (the flags themselves are `commands/gin_flags.py`'s)."""

from __future__ import annotations

import contextlib
import difflib
import logging
import os
import re
import tokenize
from collections.abc import Iterable, Sequence
from typing import Any

import gin

from t5_retrieval import artefact_io
from t5_retrieval.errors import ConfigError, UserError

# The project's gin files ship inside the package (a wheel carries them; `gin_configs/` at the top
# of a source checkout links here), so `--gin_file=models/t5_base.gin` resolves from any directory.
GIN_CONFIGS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gin_configs")


# Earlier names of t5x's launch macros, still accepted on the command line.
MACRO_ALIASES = {"MIXTURE": "MIXTURE_OR_TASK_NAME", "NUM_STEPS": "TRAIN_STEPS", "INIT_FROM": "INITIAL_CHECKPOINT_PATH"}


def split_gin_overrides(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """Separates `--gin.NAME=value` bindings (t5x syntax) from the other arguments; an alias
    (`MACRO_ALIASES`) becomes its t5x name, and t5x's `--gin.MODEL_DIR=...` becomes `--model_dir`."""
    bindings, rest = [], []
    for arg in argv:
        if arg.startswith("--gin."):
            name, sep, value = arg[len("--gin."):].partition("=")
            if not sep:
                raise ConfigError(f"--gin.{name}: expected --gin.NAME=value")
            name = MACRO_ALIASES.get(name.strip(), name.strip())
            if name == "MODEL_DIR":
                rest.append(f"--model_dir={_string_literal(value, name)}")
            else:
                bindings.append(f"{name} = {value}")
        else:
            rest.append(arg)
    return bindings, rest


def _string_literal(value: str, name: str) -> str:
    import ast

    try:
        parsed = ast.literal_eval(value)
    except (ValueError, SyntaxError):
        parsed = value  # t5x quotes it ("'/dir'"); a bare path is what was meant
    if not isinstance(parsed, str):
        raise ConfigError(f"--gin.{name}: expected a path, got {value}")
    return parsed


_COMMAND_LINE: list[str] = []  # the `--gin.X=v` bindings `parse_args` applied
GIN_FILE_BYTES = 64 << 20  # the most of a config.gin `operative_values` reads (a run's is a few KiB)
OPERATIVE_CONFIG = "config.gin"  # in a model directory: the gin bindings its training run used (t5x's name)
_FILE_LOADED: dict[str, Any] = {}  # modules `import_modules` ran from a file under a name another module holds


def _module_root(module: Any) -> str | None:
    """The directory a module was imported from (the sys.path entry holding it), absolute."""
    path = getattr(module, "__file__", None)
    if not path:
        return None
    root = os.path.dirname(os.path.abspath(path))
    for _ in range(module.__name__.count(".") + (os.path.basename(path) == "__init__.py")):
        root = os.path.dirname(root)
    return root


def _module_file(directory: str, name: str) -> str | None:
    """The file that defines module `name` in `directory` (`a/b.py` or `a/b/__init__.py` for `a.b`)."""
    base = os.path.join(directory, *name.split("."))
    return next((path for path in (base + ".py", os.path.join(base, "__init__.py")) if os.path.isfile(path)), None)


def _taken(name: str, path: str) -> bool:
    """Whether `name` already means another module than the file `path` in this process: one
    imported, or importable from `sys.path` (an installed package such as `toml` or `seqio`)."""
    import importlib.util
    import sys

    def same(origin: str | None) -> bool:
        return origin is not None and os.path.realpath(origin) == os.path.realpath(path)

    if name in sys.modules:
        return not same(getattr(sys.modules[name], "__file__", None))
    if "." in name:  # a submodule is free when its package is this directory's own
        parent = name.rpartition(".")[0]
        parent_path = _module_file(_package_root(path, name), parent)
        return parent_path is None or _taken(parent, parent_path)
    try:
        spec = importlib.util.find_spec(name)  # locates, runs nothing
    except (ImportError, ValueError):
        return True
    return spec is not None and not same(spec.origin)


def _package_root(path: str, name: str) -> str:
    """The directory holding the top package of module `name`, defined by the file `path`."""
    root = os.path.dirname(path)
    for _ in range(name.count(".") + (os.path.basename(path) == "__init__.py")):
        root = os.path.dirname(root)
    return root


def _load_file(name: str, path: str) -> Any:
    """Runs the module `name` from its own file, which `sys.path` need not hold. It is entered in
    `sys.modules` under `name` only when no other module has that name (`_taken`), so a file in a
    directory a model records never stands in for an installed package: it runs under its name,
    and `import toml` still finds the installed `toml`."""
    import importlib.util
    import sys

    taken = _taken(name, path)
    if taken and "." in name:  # a submodule needs its package, and that name is another module's
        raise ImportError(f"{path}: its package {name.rpartition('.')[0]!r} is the name of another module")
    if not taken and name in sys.modules:
        return sys.modules[name]
    key = os.path.realpath(path)
    if taken and key in _FILE_LOADED:
        return _FILE_LOADED[key]
    package = [os.path.dirname(path)] if os.path.basename(path) == "__init__.py" else None
    spec = importlib.util.spec_from_file_location(name, path, submodule_search_locations=package)
    if spec is None or spec.loader is None:
        raise ImportError(f"{path}: not a Python module")
    module = importlib.util.module_from_spec(spec)
    if taken:
        _FILE_LOADED[key] = module
    else:
        if "." in name:
            parent = name.rpartition(".")[0]
            _load_file(parent, _module_file(_package_root(path, name), parent) or path)
        sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        if taken:
            del _FILE_LOADED[key]
        else:
            sys.modules.pop(name, None)
        raise
    return module


def import_modules(modules: str | Sequence[str] | None, search_path: Sequence[str] = (),
                   recorded_in: str | None = None) -> list[str]:
    """Imports the modules that register a user's seqio Tasks and Mixtures (t5x's
    MIXTURE_OR_TASK_MODULE): each from its own file in the first of the directories `search_path`
    that holds it, else as Python imports it (`sys.path`: PYTHONPATH, installed packages), else from
    its file in the working directory. `sys.path` is never changed, so a directory a model records
    adds no other module to what Python imports, and a file there loaded under an installed
    module's name (`toml`) runs without replacing that module (`_load_file`). `recorded_in`: the
    config.gin that names them, for the error message.

    Returns the directories they came from that are not absolute `sys.path` entries (the working
    directory, a relative entry, `search_path`): where a run started elsewhere must look."""
    import importlib
    import sys

    portable = {os.path.normpath(p) for p in sys.path if p and os.path.isabs(p)}
    directories = list(dict.fromkeys(os.path.abspath(d) for d in search_path))
    found = []
    for name in [modules] if isinstance(modules, str) else modules or ():
        try:
            module, root = None, None  # type: tuple[Any, str | None]
            for directory in directories:
                if (path := _module_file(directory, name)) is not None:
                    module, root = _load_file(name, path), directory
                    break
            if module is None:
                try:
                    module = importlib.import_module(name)
                    root = _module_root(module)
                except ModuleNotFoundError as e:
                    here = _module_file(os.getcwd(), name)
                    if e.name != name.partition(".")[0] or here is None:
                        raise
                    module, root = _load_file(name, here), os.getcwd()
        except ImportError as e:
            where = f" (the Task module {recorded_in} records" if recorded_in else ""
            if recorded_in:
                where += f", from {', '.join(directories)})" if directories else ")"
            raise UserError(f"MIXTURE_OR_TASK_MODULE {name!r}{where}: cannot import it ({e}); put its directory on "
                            "PYTHONPATH" + (" or name another with --gin.MIXTURE_OR_TASK_MODULE" if recorded_in else "")
                            ) from None
        if root is not None and os.path.normpath(root) not in portable and root not in found:
            found.append(root)
    return found


def recorded_task_modules(config_path: str) -> tuple[list[str], list[str]]:
    """The MIXTURE_OR_TASK_MODULE(s) a training run's config.gin records
    (`make_train_iterator.task_module`) and the directories to import them from
    (`make_train_iterator.task_module_path`); nothing for a file that records none."""
    if not os.path.lexists(config_path):
        return [], []
    artefact_io.check_regular(config_path, os.path.dirname(config_path) or ".")  # the model directory's own
    modules: list[str] = []
    for value in operative_values(config_path, "make_train_iterator", "task_module"):
        modules += [value] if isinstance(value, str) else list(value or ())
    path = [d for value in operative_values(config_path, "make_train_iterator", "task_module_path") for d in value or ()]
    return list(dict.fromkeys(modules)), list(dict.fromkeys(path))


def macro_is_set(name: str) -> bool:
    """A gin file or `--gin.NAME=...` flag of this run defines the macro `name`."""
    return (name, "gin.macro") in gin.config._CONFIG


def bound_value(selector: str) -> Any:
    """The value `configurable.param` is bound to, macros followed; None when unbound."""
    try:
        value = gin.query_parameter(selector)
    except ValueError:
        return None
    while isinstance(value, gin.config.ConfigurableReference) and value.scoped_selector.endswith("/gin.macro"):
        value = gin.query_parameter("%" + value.scoped_selector[:-len("/gin.macro")])
    return value


def _absolute(value: Any) -> Any:
    if isinstance(value, str) and value and not os.path.isabs(value):
        return os.path.abspath(value)
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        return type(value)(_absolute(v) for v in value)
    return value


def bind_absolute_paths(selectors: Iterable[str]) -> None:
    """Rebinds each of these path-valued parameters that is bound to a relative path (a string or
    a list of strings) to the absolute path, where its value is written: the macro it reads, or the
    parameter itself. So the operative config a run records means the same from any directory."""
    for selector in selectors:
        try:
            value = gin.query_parameter(selector)
        except ValueError:
            continue
        target = selector
        while isinstance(value, gin.config.ConfigurableReference) and value.scoped_selector.endswith("/gin.macro"):
            target = value.scoped_selector + ".value"
            value = gin.query_parameter("%" + value.scoped_selector[:-len("/gin.macro")])
        if _absolute(value) != value:
            gin.bind_parameter(target, _absolute(value))


def _is_configurable(name: str) -> bool:
    try:
        gin.query_parameter(f"{name}.__dict__")
    except ValueError as e:
        return "No configurable matching" not in str(e)
    return True


def unread_bindings(bindings: Sequence[str] | None = None) -> list[str]:
    """Of these `configurable.param = value` bindings (default: the command line's), those whose
    configurable this run never called (not in gin's operative config): values that would silently
    do nothing."""
    bindings = _COMMAND_LINE if bindings is None else bindings
    called = {name for _, name in gin.config._OPERATIVE_CONFIG}  # (scope, configurable name)
    called |= {name.rpartition(".")[2] for name in called}
    unread = []
    for binding in bindings:
        target = binding.partition("=")[0].strip()
        configurable = target.rpartition(".")[0].rpartition("/")[2]
        if configurable and configurable not in called:
            unread.append(target)
    return unread


def operative_values(config_path: str, configurable: str, parameter: str) -> list[Any]:
    """The values a run's operative config (`<model_dir>/config.gin`) gives `configurable.parameter`,
    in any scope, without parsing the whole file (which needs every module it names imported).

    gin writes each selector as its shortest unique suffix (`taco.tau` for `multitask.taco.tau`) and
    every parameter the call used, defaults included. Only literal values (or a macro `%NAME` whose
    literal value the file defines) are read, also where gin wraps a long one over several lines.
    """
    import ast
    import re

    parts = configurable.split(".")
    names = "|".join(re.escape(".".join(parts[i:])) for i in range(len(parts)))
    pattern = re.compile(rf"^(?:\S+/)?(?:{names})\.{re.escape(parameter)}\s*=\s*(.+?)\s*$")
    lines = _statements(artefact_io.read_text(config_path, GIN_FILE_BYTES))  # a regular file, bounded
    macros: dict[str, str] = dict((m[1], m[2]) for line in lines if (m := re.match(r"^([A-Z_][A-Z0-9_]*)\s*=\s*(.+?)\s*$", line)))

    def literal(text: str) -> Any:
        text = macros.get(text[1:], text) if text.startswith("%") else text
        try:
            return ast.literal_eval(text)
        except (ValueError, SyntaxError):
            raise UserError(f"{config_path}: {configurable}.{parameter} = {text}: not a literal value") from None

    return [literal(m.group(1)) for line in lines if (m := pattern.match(line))]


def _statements(text: str) -> list[str]:
    """gin's statements one per line: a value gin wraps (after a `\\`, or inside brackets) joined
    into its statement's line, as Python's tokenizer reads gin's syntax."""
    import io

    physical = text.splitlines()
    ends, depth = [], 0
    try:
        for token in tokenize.generate_tokens(io.StringIO(text).readline):
            if token.type == tokenize.OP and token.string in "([{":
                depth += 1
            elif token.type == tokenize.OP and token.string in ")]}":
                depth -= 1
            elif token.type == tokenize.NEWLINE or (token.type == tokenize.NL and depth == 0):
                ends.append(token.start[0])
    except (tokenize.TokenError, SyntaxError):
        return physical
    out, start = [], 0
    for end in ends:
        if end > start:
            out.append(" ".join(line.rstrip().removesuffix("\\").strip() for line in physical[start:end]))
            start = end
    return out


def parse_gin(gin_files: Sequence[str], bindings: Sequence[str], search_paths: Sequence[str] = ()) -> None:
    """Loads gin files (resolved against the search paths and gin_configs/) and applies bindings."""
    for path in [*search_paths, GIN_CONFIGS_DIR]:
        gin.add_config_file_search_path(path)
    # gin probes each search path with a reader that logs "Path not found" at ERROR for every miss.
    logging.disable(logging.ERROR)
    try:
        for path in gin_files:  # one at a time, so that an unreadable file is named
            with _naming(path):
                gin.parse_config_file(path)
        with _naming("the --gin. bindings"):
            gin.parse_config(list(bindings))
    finally:
        logging.disable(logging.NOTSET)


@contextlib.contextmanager
def _naming(source: str):
    """Turns what gin's reader raises for a file it cannot read into a one-line ConfigError naming
    `source:line:column` (the column where gin or the tokenizer stopped): syntax errors, a bare word
    where a value belongs, unbalanced brackets (gin's tokenizer raises `tokenize.TokenError`), bytes
    that are not UTF-8, and an unknown configurable or parameter."""
    try:
        yield
    except ConfigError:
        raise
    except SyntaxError as e:
        where = f"{e.filename or source}:{e.lineno}:{(e.offset or 0) + 1}" if e.lineno else (e.filename or source)
        raise ConfigError(f"gin: {where}: {_syntax_message(e.msg)} ({(e.text or '').strip()!r})") from None
    except tokenize.TokenError as e:
        message, (line, column) = e.args
        raise ConfigError(f"gin: {source}:{line}:{column + 1}: {message}") from None
    except UnicodeDecodeError as e:
        before = e.object[:e.start]
        line, column = before.count(b"\n") + 1, e.start - (before.rfind(b"\n") + 1) + 1
        raise ConfigError(f"gin: {source}:{line}:{column}: not UTF-8 (byte 0x{e.object[e.start]:02x}); "
                          "gin files are UTF-8 text") from None
    except ValueError as e:
        raise ConfigError(_located(str(e), source)) from None


_BARE_WORD = re.compile(r"Failed to parse token '(?P<token>[A-Za-z_]\w*)'")
# What gin appends to an error raised while it applies a binding (`gin.utils._format_location`).
_GIN_LOCATION = re.compile(r'\n\s*In (?:file "(?P<file>.*)",|bindings string) line (?P<line>\d+)\n {4}(?P<text>.*)'
                           r'(?:\n {4}(?P<caret> *)\^)?\s*$')


def _syntax_message(message: str) -> str:
    """gin's parse error in one line; a bare word (`= foo`, which gin hands to `ast.literal_eval`)
    says what value it could have been meant as."""
    bare = _BARE_WORD.search(message)
    if bare:
        word = bare.group("token")
        return (f"{word!r} is a bare word, not a gin value: quote a string ('{word}'), or write @{word} for a "
                f"configurable, %{word} for a macro")
    return " ".join(message.split())


def _located(message: str, source: str) -> str:
    """A gin error with gin's location lines (file, line, the statement, a caret) as one line:
    `gin: file:line:column: what ('statement')`."""
    found = _GIN_LOCATION.search(message)
    if not found:
        return f"gin: {source}: {' '.join(message.split())}"
    column = len(found.group("caret") or "") + 1
    what = " ".join(message[:found.start()].split()).rstrip(".")
    return f"gin: {found.group('file') or source}:{found.group('line')}:{column}: {what} ({found.group('text').strip()!r})"


def _macro_references(value: Any, out: set[str]) -> None:
    if isinstance(value, gin.config.ConfigurableReference):
        selector = value.scoped_selector
        if selector.endswith("/gin.macro"):
            out.add(selector[:-len("/gin.macro")])
    elif isinstance(value, (list, tuple)):
        for item in value:
            _macro_references(item, out)
    elif isinstance(value, dict):
        for item in value.values():
            _macro_references(item, out)


def unread_macros(names: Iterable[str]) -> list[str]:
    """Of these macro names, those no binding of the parsed config refers to (`%NAME`): a value set
    on the command line that nothing would read, usually a typo or another project's name."""
    read: set[str] = set()
    for params in gin.config._CONFIG.values():  # gin keeps no public view of the parsed bindings
        for value in params.values():
            _macro_references(value, read)
    return [name for name in names if name not in read]


def undefined_macros() -> list[str]:
    """Macros some binding reads (`%NAME`) that no gin file or flag defines."""
    read: set[str] = set()
    for params in gin.config._CONFIG.values():
        for value in params.values():
            _macro_references(value, read)
    defined = {scope_name[0] for scope_name in gin.config._CONFIG if scope_name[1] == "gin.macro"}
    return sorted(read - defined)


def required_macros() -> list[str]:
    """Macros the parsed gin files leave as `%gin.REQUIRED` (the run must set them)."""
    return sorted(scope_name[0] for scope_name, params in gin.config._CONFIG.items()
                  if scope_name[1] == "gin.macro"
                  and isinstance(params.get("value"), gin.config.ConfigurableReference)
                  and params["value"].scoped_selector.startswith("gin.REQUIRED"))


def _macro_names(bindings: Sequence[str]) -> list[str]:
    """`NAME = value` bindings (macros), not `configurable.param = value` ones."""
    names = [b.partition("=")[0].strip() for b in bindings]
    return [n for n in names if n and "." not in n and "/" not in n]


def apply_command_line(gin_files: Sequence[str], bindings: Sequence[str], search_paths: Sequence[str] = ()) -> None:
    """Parses a command's gin files and bindings (`--gin.` flags as `split_gin_overrides` returns
    them), checked before any work starts.

    Raises UserError naming it for a binding gin cannot apply (an unknown configurable or parameter,
    a missing file), a macro bound on the command line that no gin file reads and a
    `%gin.REQUIRED` macro left unset.
    """
    try:
        parse_gin(gin_files, bindings, search_paths)
    except ConfigError:
        raise
    except (ValueError, OSError) as e:  # gin adds where on lines of their own: one line for `t5r`
        raise ConfigError(f"gin: {' '.join(str(e).split())}") from None
    _COMMAND_LINE[:] = bindings
    defined = [k[0] for k in gin.config._CONFIG if k[1] == "gin.macro"]
    unread = unread_macros(_macro_names(bindings))
    if "INITIAL_CHECKPOINT_PATH" in unread and _is_configurable("train"):
        # t5x's name for the checkpoint a run starts from, where no gin file reads it as a macro.
        gin.bind_parameter("train.init_from", gin.query_parameter("%INITIAL_CHECKPOINT_PATH"))
        unread.remove("INITIAL_CHECKPOINT_PATH")
    if "MIXTURE_OR_TASK_MODULE" in unread:  # a command that reads Tasks by name only (eval, serve, ...)
        import_modules(gin.query_parameter("%MIXTURE_OR_TASK_MODULE"))
        unread.remove("MIXTURE_OR_TASK_MODULE")
    if unread:
        name = unread[0]
        near = difflib.get_close_matches(name, [d for d in defined if d != name], n=3)
        raise ConfigError(f"--gin.{name}: no gin file reads %{name}, so the value would be ignored"
                          + (f" (did you mean {', '.join(near)}?)" if near else ""))
    unset = [*undefined_macros(), *required_macros()]  # before any work, not when a configurable needs it
    if unset:
        names = ", ".join(unset)
        raise ConfigError(f"gin: {names} {'is' if len(unset) == 1 else 'are'} required by "
                          f"{' '.join(gin_files) or 'the gin bindings'}; set "
                          f"{'it' if len(unset) == 1 else 'them'}, e.g. "
                          + " ".join(f"--gin.{name}=..." for name in unset))

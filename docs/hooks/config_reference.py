"""mkdocs hook: the configuration reference, generated at build time from the schemas and conf/.

configuration.md holds the marker below; this hook replaces it with
- the run-wide keys and the nested sections (logger, logger.wandb, test, accel) of the root schema;
- for each config group: its options (the files under conf/GROUP/, what each sets and brings) and
  its schemas (the dataclasses registered in the group), one table each: key, type, default and
  the comment written beside the field in its source;
- the options of conf/hydra/launcher and conf/hydra/sweeper.

Schemas are found only through `torchbeast_hydra.config.register_configs()` and Hydra's
ConfigStore, never by module path, so the page follows the schemas wherever they live.
"""

from __future__ import annotations

import ast
import dataclasses
import enum
import inspect
import io
import re
import sys
import textwrap
import tokenize
import typing
from pathlib import Path

MARKER = "<!-- config-reference -->"
PAGE = "configuration.md"
PACKAGE = "torchbeast_hydra"
DOCS = Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------------------- the schemas


def schemas_by_group() -> dict[str, list[tuple[str, type]]]:
    """ConfigStore's entries of this package: group ("" for the root) -> [(name, dataclass)]."""
    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf

    from torchbeast_hydra.config import register_configs

    register_configs()
    found: dict[str, list[tuple[str, type]]] = {}

    def walk(tree: dict, group: str) -> None:
        for key, value in tree.items():
            if isinstance(value, dict):
                walk(value, f"{group}/{key}" if group else key)
                continue
            schema = OmegaConf.get_type(value.node)
            if dataclasses.is_dataclass(schema) and schema.__module__.split(".")[0] == PACKAGE:
                found.setdefault(group, []).append((key.removesuffix(".yaml"), schema))

    walk(ConfigStore.instance().repo, "")
    return found


def own_schemas(schemas: list[type]) -> list[type]:
    """The schemas and their dataclass bases of this package, each base before what extends it."""
    ordered: list[type] = []
    for schema in schemas:
        for cls in reversed(schema.__mro__):
            if dataclasses.is_dataclass(cls) and cls.__module__.split(".")[0] == PACKAGE and cls not in ordered:
                ordered.append(cls)
    return ordered


def source_comments(cls: type) -> dict[str, str]:
    """Each name assigned in the class body -> the comment above it (contiguous lines) and beside it."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    lines = source.splitlines()
    comment_on: dict[int, str] = {}  # 1-based line -> its comment's text
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            comment_on[token.start[0]] = token.string.lstrip("#").strip()
    body = ast.parse(source).body[0].body
    comments = {}
    for statement in body:
        if isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name):
            name = statement.target.id
        elif (
            isinstance(statement, ast.Assign)
            and len(statement.targets) == 1
            and isinstance(statement.targets[0], ast.Name)
        ):
            name = statement.targets[0].id
        else:
            continue
        above, line = [], statement.lineno - 1
        while line >= 1 and line in comment_on and lines[line - 1].lstrip().startswith("#"):
            above.insert(0, comment_on[line])
            line -= 1
        beside = [comment_on[n] for n in range(statement.lineno, statement.end_lineno + 1) if n in comment_on]
        text = " ".join(above + beside).strip()
        if text:
            comments[name] = text
    return comments


def type_name(hint) -> str:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Union and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return " or ".join(type_name(a) for a in rest) + " or null"
    if origin in (list, typing.List):
        return f"list of {type_name(args[0])}" if args else "list"
    if origin in (dict, typing.Dict):
        return "dict"
    if hint is typing.Any:
        return "any"
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return "one of " + ", ".join(f"`{member.value}`" for member in hint)
    return getattr(hint, "__name__", str(hint))


def default_text(field: dataclasses.Field) -> str:
    if field.default is not dataclasses.MISSING:
        value = field.default
    elif field.default_factory is not dataclasses.MISSING:
        value = field.default_factory()
    else:
        return "required"
    if value == "???":  # omegaconf.MISSING
        return "required"
    return f"`{yaml_text(value)}`"


def yaml_text(value) -> str:
    """A value as it is typed in YAML or on the command line."""
    if isinstance(value, enum.Enum):
        return str(value.value)
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(yaml_text(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {yaml_text(v)}" for k, v in value.items()) + "}"
    return str(value)


def cell(text: str) -> str:
    """Text that stays inside one cell of a Markdown table."""
    return text.replace("|", "\\|").replace("\n", " ")


def enum_notes(hint) -> str:
    """The comments beside an enum's members, e.g. OnNonFinite: `skip`: drop that update ..."""
    members = [a for a in (typing.get_args(hint) or (hint,)) if isinstance(a, type) and issubclass(a, enum.Enum)]
    notes = []
    for members_of in members:
        comments = source_comments(members_of)
        notes += [f"`{m.value}`: {comments[m.name]}" for m in members_of if m.name in comments]
    return "; ".join(notes)


def field_table(cls: type, prefix: str, only_own: bool, skip: set[str] = frozenset()) -> list[str]:
    """A table of the class's fields (only those it declares itself when only_own), keyed as typed."""
    try:
        hints = typing.get_type_hints(cls)
    except Exception:  # an annotation that does not resolve: show it as written
        hints = {}
    own = set(inspect.get_annotations(cls))
    comments = {}
    for base in reversed(cls.__mro__):  # a subclass's comment wins over its base's
        if base in own_schemas([cls]) and (not only_own or base is cls):
            comments.update(source_comments(base))
    rows = ["| key | type | default | what it does |", "|---|---|---|---|"]
    for field in dataclasses.fields(cls):
        if field.name in skip or (only_own and field.name not in own):
            continue
        hint = hints.get(field.name, field.type)
        text = comments.get(field.name, "")
        if not text and only_own:
            overridden = [b.__name__ for b in cls.__mro__[1:] if field.name in inspect.get_annotations(b)]
            text = f"as in `{overridden[0]}`, with this default" if overridden else ""
        notes = enum_notes(hint)
        text = f"{text} ({notes})" if text and notes else text or notes
        cells = [f"`{prefix}{field.name}`", type_name(hint), default_text(field), prose([text])]
        rows.append("| " + " | ".join(cell(c) for c in cells) + " |")
    return rows if len(rows) > 2 else []


def docstring(cls: type) -> str:
    text = inspect.getdoc(cls) or ""
    inherited = next((inspect.getdoc(b) for b in cls.__mro__[1:] if b.__doc__), None)
    if cls.__doc__ is None or text == inherited or text.startswith(cls.__name__ + "("):  # dataclass's own
        return ""
    return " ".join(text.split())


# ----------------------------------------------------------------------------- conf/


LINE = re.compile(r"^(?P<indent>\s*)(?P<key>[\w.+/@-]+):\s*(?P<value>.*?)\s*(?:#\s*(?P<comment>.*))?$")


def conf_file(path: Path) -> dict:
    """A conf/ YAML file read for the reference: its header comment, its defaults list, and each
    key it sets (dotted, with the value as written and the comment beside or above it)."""
    header, defaults, keys = [], [], []
    lines = path.read_text().splitlines()
    at = 0
    while at < len(lines) and lines[at].startswith("#"):
        if not lines[at].startswith("# @package"):
            header.append(lines[at][1:].removeprefix(" ").rstrip())
        at += 1
    stack: list[tuple[int, str]] = []  # (indent, key) of the enclosing mappings
    above: list[str] = []
    in_defaults = False
    for line in lines[at:]:
        stripped = line.strip()
        if not stripped:
            above = []
            continue
        if stripped.startswith("#"):
            above.append(stripped.lstrip("#").strip())
            continue
        if stripped.startswith("- ") and in_defaults:
            defaults.append(stripped[2:].split("#")[0].strip())
            continue
        match = LINE.match(line)
        if not match:
            continue
        indent = len(match["indent"])
        while stack and stack[-1][0] >= indent:
            stack.pop()
        in_defaults = indent == 0 and match["key"] == "defaults"
        path_ = ".".join([k for _, k in stack] + [match["key"]])
        if match["value"] or in_defaults:
            if not in_defaults:
                keys.append((path_, match["value"], " ".join(above + [match["comment"] or ""]).strip()))
        else:
            stack.append((indent, match["key"]))
        above = []
    return {"header": header, "defaults": defaults, "keys": keys}


def prose(lines: list[str]) -> str:
    """Comment lines as one Markdown paragraph: angle brackets outside `code` kept as text (not read
    as HTML tags), and a docs/PAGE.md that exists made a link to that page."""
    text = " ".join(line.strip() for line in lines)
    parts = text.split("`")
    parts[::2] = [part.replace("<", "&lt;").replace(">", "&gt;") for part in parts[::2]]
    text = "`".join(parts)
    return re.sub(r"docs/([\w-]+\.md)", lambda m: f"[{m[1]}]({m[1]})" if (DOCS / m[1]).exists() else m[0], text)


def header_parts(header: list[str]) -> list[tuple[str, list[str]]]:
    """A header comment as ("text", lines) paragraphs and ("code", lines) examples (indented lines)."""
    parts: list[tuple[str, list[str]]] = []
    for line in header:
        kind = "code" if line.startswith("  ") else "text"
        if parts and parts[-1][0] == kind:
            parts[-1][1].append(line)
        else:
            parts.append((kind, [line]))
    return parts


def about(header: list[str]) -> str:
    """A header comment's prose, less its examples and its pointer to the schema (the table names it)."""
    text = prose([line for kind, lines in header_parts(header) if kind == "text" for line in lines])
    return re.sub(r"\s*Its keys and their defaults:[^.]*(\.[A-Za-z_]+)*[^.]*\.", "", text).strip()


# What the options of a group without a schema of its own set (each sets keys of other groups).
GLOBAL_GROUPS = {
    "ablation": "one lever of a preset turned off, after the preset",
    "task": "a task's env id and its own settings in a suite that sweeps it (`task=CartPole-v1`), after the "
    "preset and before the command line ([Benchmark suites](sweeps-and-slurm.md#per-task-settings))",
}


def options_table(conf: Path, group: str, schema_names: dict[str, str]) -> list[str]:
    files = sorted((conf / group).glob("*.yaml"))
    if not files:
        return []
    rows = ["| option | schema | sets | about |", "|---|---|---|---|"]
    for path in files:
        read = conf_file(path)
        schema, brings = "", []
        for entry in read["defaults"]:
            if entry in schema_names:
                schema = f"`{schema_names[entry]}`"
            elif entry.startswith("override "):
                target, _, option = entry.removeprefix("override ").partition(":")
                target = target.strip().lstrip("/").split("@")[0]
                brings.append(f"`{target}={option.strip()}`")
        sets = [f"`{key}={value}`" for key, value, _ in read["keys"]]
        if brings:
            sets.append("brings " + ", ".join(brings))
        rows.append(f"| `{group}={path.stem}` | {schema} | {cell(', '.join(sets))} | {cell(about(read['header']))} |")
    return rows


def hydra_options(conf: Path, group: str) -> list[str]:
    """conf/hydra/GROUP/*.yaml: each option's header and its keys (hydra.GROUP.KEY)."""
    out = []
    key_prefix = "hydra." + group.split("/")[-1] + "."
    for path in sorted((conf / group).glob("*.yaml")):
        read = conf_file(path)
        extends = ", ".join(f"`{entry}`" for entry in read["defaults"])
        out += [f"### `{group}={path.stem}`", ""]
        for kind, lines in header_parts(read["header"]):
            code = textwrap.dedent("\n".join(lines)).splitlines()
            out += ["```bash", *code, "```", ""] if kind == "code" else [prose(lines), ""]
        if extends:
            out += [f"Extends {extends}; any of its keys can be set too.", ""]
        out += ["| key | value | what it does |", "|---|---|---|"]
        out += [f"| `{key_prefix}{key}` | `{cell(value)}` | {cell(prose([c]))} |" for key, value, c in read["keys"]]
        out.append("")
    return out


# ----------------------------------------------------------------------------- the page


def schema_section(cls: type, prefix: str, registered: dict[type, str]) -> list[str]:
    name = registered.get(cls)
    title = f"`{cls.__name__}`" + (f" (`{name}`)" if name else " (a base: not an option of its own)")
    bases = [b.__name__ for b in cls.__bases__ if dataclasses.is_dataclass(b)]
    out = [f"#### {title}", ""]
    if docstring(cls):
        out += [prose([docstring(cls)]), ""]
    table = field_table(cls, prefix, only_own=bool(bases))
    if bases:
        extends = "Extends " + ", ".join(f"`{b}`" for b in bases)
        their = "its" if len(bases) == 1 else "their"
        out += [extends + (f": {their} fields, and those below." if table else ", adding no fields of its own."), ""]
    return out + table + [""]


def reference(conf: Path) -> str:
    groups = schemas_by_group()
    (root_name, root), *_ = groups.pop("")
    group_names = set(groups)
    out = [
        "## Run-wide keys",
        "",
        f"The root schema `{root.__name__}` (`{root_name}`): keys typed without a group.",
        "",
    ]
    nested = []
    for field in dataclasses.fields(root):
        factory = field.default_factory
        if field.name in group_names:  # a group's own section says it (pbt: its options set the root's key)
            continue
        if factory is not dataclasses.MISSING and dataclasses.is_dataclass(made := factory()):
            nested.append((field.name, type(made)))
    out += field_table(root, "", only_own=False, skip=group_names | {name for name, _ in nested}) + [""]

    def nested_sections(prefix: str, cls: type) -> None:
        out.extend([f"## {prefix}", ""])
        if docstring(cls):
            out.extend([prose([docstring(cls)]), ""])
        inner = []
        for field in dataclasses.fields(cls):
            factory = field.default_factory
            if factory is not dataclasses.MISSING and dataclasses.is_dataclass(made := factory()):
                inner.append((field.name, type(made)))
        out.extend(field_table(cls, prefix + ".", only_own=False, skip={n for n, _ in inner}) + [""])
        for name, inner_cls in inner:
            nested_sections(f"{prefix}.{name}", inner_cls)

    for name, cls in nested:
        nested_sections(name, cls)

    root_fields = [f.name for f in dataclasses.fields(root)]
    for group in sorted(groups, key=lambda g: root_fields.index(g) if g in root_fields else len(root_fields)):
        entries = groups[group]
        registered = {cls: name for name, cls in entries}
        out += [f"## {group}", ""]
        options = options_table(conf, group, {name: cls.__name__ for name, cls in entries})
        if options:
            out += [f"Options (`conf/{group}/`):", "", *options, ""]
        out += [f"### Schemas of `{group}`", ""]
        for cls in own_schemas([cls for _, cls in entries]):  # a schema's own prefix, where its keys sit deeper
            out += schema_section(cls, getattr(cls, "reference_prefix", group + "."), registered)

    others = sorted(p.name for p in conf.iterdir() if p.is_dir() and p.name not in groups and p.name != "hydra")
    for group in others:  # presets with no schema of their own (experiment, ablation, task)
        what = GLOBAL_GROUPS.get(group, "presets over the groups above")
        out += [f"## {group}", "", f"Options (`conf/{group}/`): {what}.", ""]
        out += options_table(conf, group, {}) + [""]

    out += ["## hydra", "", "This project's presets for Hydra's launcher and sweeper groups.", ""]
    for group in ("hydra/launcher", "hydra/sweeper"):
        out += hydra_options(conf, group)
    return "\n".join(out)


def on_config(config, **kwargs):
    """Makes the checkout's package importable when it is not installed (mkdocs serve from a clone)."""
    root = str(Path(config.config_file_path).resolve().parent)
    if root not in sys.path:
        sys.path.insert(0, root)
    return config


FAMILIES_PAGE = "env-families.md"
FAMILIES_MARKER = "<!-- env-families -->"


def families_table() -> str:
    """The env families' table (torchbeast_hydra/env/families.py), as --help shows it."""
    from torchbeast_hydra.env import families

    rows = ["| option | default id | model it brings | install | what the defaults learn |", "|---|---|---|---|---|"]
    for f in families.FAMILIES:
        rows.append(
            f'| `env={f.option}` | `{f.default_id}` | `model={f.model}` | `pip install ".[{f.option}]"` | {f.learns} |'
        )
    return "\n".join(rows)


def on_page_markdown(markdown: str, page, config, files, **kwargs):
    if page.file.src_uri == FAMILIES_PAGE:
        return markdown.replace(FAMILIES_MARKER, families_table())
    if page.file.src_uri != PAGE:
        return markdown
    if MARKER not in markdown:
        raise ValueError(f"{PAGE} has lost its marker {MARKER}: the configuration reference has nowhere to go")
    conf = Path(config.config_file_path).resolve().parent / "conf"
    return markdown.replace(MARKER, reference(conf))

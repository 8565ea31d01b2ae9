"""Read a run's arguments from the command line, a YAML or a JSON file, or a file plus overrides.

[`CachedLossArgumentParser`][st_cached_losses.config.cli.CachedLossArgumentParser] is transformers' ``HfArgumentParser`` with what a run of a cached loss
needs on top:

* a misspelt key or flag is an error that names the closest field, raised before any dataclass is
  built (``HfArgumentParser`` builds them first, so a typo'd ``mini_bach_size`` used to warn that
  "caching is off" for the default mini-batch size before its own error, which names no field);
* ``--help`` lists the loss fields first, then the script's own, then names the ~120 training arguments
  (``--help_all`` describes each), shows each default once, and keeps the line breaks of the script's docstring;
* [`parse_command_line`][st_cached_losses.config.cli.CachedLossArgumentParser.parse_command_line] takes ``script.py run.yaml`` and ``script.py
  --config run.yaml --max_steps 10`` as well as flags, over a script's own defaults; setting ``scale``
  replaces a ``temperature`` given by a lower-priority source (and the other way round), so that
  ``--scale 30`` works on a script whose defaults name a temperature;
* from a shell, a configuration error is one ``error:`` line and exit status 2, as argparse does.

Example:

```python
from st_cached_losses import CachedLossArgumentParser

(args,) = CachedLossArgumentParser().parse_yaml_file("run.yaml")
data_args, args = CachedLossArgumentParser((DataArguments, CachedLossTrainingArguments)).parse_command_line(
    defaults={"loss": "clip", "per_device_train_batch_size": 64}
)
```
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import json
import os
import re
import sys
import textwrap
import types
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Optional, Union, get_args, get_origin, get_type_hints

from transformers import HfArgumentParser

from st_cached_losses.config.registry import FIELD_NAMES, closest_name_hint
from st_cached_losses.config.training_args import (
    COUNT_OR_ALL_FIELDS,
    COUNT_OR_AUTO_FIELDS,
    LOSS_FIELDS,
    SAME_DATASET,
    CachedLossArguments,
    CachedLossTrainingArguments,
)

#: fields that say the same thing in two ways: a source that sets one drops the others from the sources
#: below it (script defaults < configuration file < command line)
ALTERNATIVE_FIELDS: tuple[tuple[str, ...], ...] = (("scale", "temperature"),)
CONFIG_SUFFIXES = (".yaml", ".yml", ".json")
#: the training arguments ``--help`` describes (a run sets them most; the one this package adds a value to);
#: it names the others, ``--help_all`` describes them too
DESCRIBED_TRAINING_FIELDS = (
    "output_dir",
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "learning_rate",
    "num_train_epochs",
    "max_steps",
    "batch_sampler",
    "multi_dataset_batch_sampler",
)
USAGE = "%(prog)s [CONFIG.yaml | --config CONFIG.yaml] [--FIELD VALUE ...]"


#: a help text that states its field's default in its own words (then ``(default: ...)`` is not added): "default
#: 64 MiB", "None: every row", "required"
_STATES_DEFAULT = re.compile(r"\bdefaults?\b|\bNone:|\brequired\b", re.IGNORECASE)


def field_hint(key: str, fields: Sequence[str]) -> str:
    """The hint for an unknown field ``key``: a loss setting whose field has another name (``bias`` is
    ``siglip_bias``) names that field; anything else the closest field."""
    field = FIELD_NAMES.get(key)
    if field is not None and field in fields:
        return f" The loss setting {key!r} is the field {field!r}."
    return closest_name_hint(key, fields)


class _HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Keeps the description's line breaks (a script's docstring, with its example commands) and shows
    every field's default once: not where the help already states it ("default 64 MiB", "Default: the loss's
    own"), nor a ``--no_<field>`` flag's (``False``: what the flag sets, not a default)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if isinstance(action, argparse._StoreFalseAction) or _STATES_DEFAULT.search(action.help or ""):
            return action.help
        if action.default is None and action.dest in LOSS_FIELDS:
            # a loss field left unset gives the loss its own default, which "None" would misstate
            return f"{action.help} (default: the loss's own)"
        return super()._get_help_string(action)


class _HelpAllAction(argparse.Action):
    """``--help_all``: ``--help`` with every training argument described (``--help`` names them only)."""

    def __init__(self, option_strings: Sequence[str], dest: str = argparse.SUPPRESS, **kwargs: Any) -> None:
        super().__init__(option_strings, dest=dest, default=argparse.SUPPRESS, nargs=0, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> None:
        assert isinstance(parser, CachedLossArgumentParser)
        for action, text in parser._brief_help.items():
            action.help = text
        for group, description in parser._brief_groups.items():
            group.description = description
        parser.print_help()
        parser.exit()


def load_config(path: str | os.PathLike[Any]) -> dict[str, Any]:
    """The mapping of field names to values in a YAML (``.yaml`` / ``.yml``) or JSON file.

    Raises:
        ImportError: for a YAML file without PyYAML installed.
        ValueError: for a file that is missing, unreadable, not valid YAML / JSON, or does not hold a mapping
            (one line, naming the file and, for a syntax error, the line and column).
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ValueError(f"configuration file {str(path)!r} not found.") from None
    except (OSError, UnicodeDecodeError) as err:
        reason = err.strerror if isinstance(err, OSError) and err.strerror else str(err)
        raise ValueError(f"cannot read configuration file {str(path)!r}: {reason}.") from None
    if path.suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise ValueError(
                f"{path} is not valid JSON: {err.msg} at line {err.lineno}, column {err.colno}."
            ) from None
    else:
        try:
            import yaml
        except ImportError as err:  # pragma: no cover - PyYAML comes with transformers today
            raise ImportError(
                f"reading {path} needs PyYAML: pip install pyyaml (or, in a clone of the repository, pip install '.[yaml]'), "
                "or write the configuration as JSON."
            ) from err
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as err:
            raise ValueError(f"{path} is not valid YAML: {_yaml_problem(err)}.") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a mapping of field names to values, got {type(data).__name__}.")
    return data


def _yaml_problem(err: Exception) -> str:
    """A PyYAML error in one line: what is wrong and where (PyYAML's own message spans several lines)."""
    problem = getattr(err, "problem", None) or getattr(err, "context", None)
    mark = getattr(err, "problem_mark", None) or getattr(err, "context_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    return f"{problem}{where}" if problem else " ".join(str(err).split())


_ROLE = re.compile(r":(?:py:)?(?:class|meth|func|data|mod|attr|obj|exc|ref|doc):`~?([^`<]*?)(?:\s*<[^>]*>)?`")
_LITERAL = re.compile(r"``(.+?)``", re.DOTALL)
#: a Markdown cross-reference of mkdocstrings / autorefs: [`title`][identifier] or [title][identifier]
_CROSS_REFERENCE = re.compile(r"\[`?([^\]`]+)`?\]\[[\w.]*\]")


def plain_text(text: str) -> str:
    """``text`` (a docstring, a field's help) without its markup, for ``--help``: the docstrings' Markdown
    cross-references ``[`C`][a.b.C]`` -> ``C``; reStructuredText's roles `` :class:`~a.b.C` `` -> ``C`` and
    `` :class:`a.b.C` `` -> ``a.b.C``, double-backtick literals -> their text, ``Example::`` -> ``Example:``."""

    def role(match: re.Match[str]) -> str:
        target = match.group(1)
        return target.rsplit(".", 1)[-1] if match.group(0).split("`", 1)[1].startswith("~") else target

    text = _ROLE.sub(role, text)
    text = _CROSS_REFERENCE.sub(r"\1", text)
    text = _LITERAL.sub(r"\1", text)
    return re.sub(r"(\w)::$", r"\1:", text, flags=re.MULTILINE)


def _count_or_auto(text: str) -> int | str:
    """A count, or ``"auto"`` (sized from ``mini_batch_memory_budget``)."""
    return "auto" if text.strip().lower() == "auto" else int(text)


_count_or_auto.__name__ = "integer or 'auto'"  # argparse's "invalid <name> value" message


def _count_or_all(text: str) -> int | str:
    """A count, or ``"all"`` (every one there is)."""
    return "all" if text.strip().lower() == "all" else int(text)


_count_or_all.__name__ = "integer or 'all'"  # argparse's "invalid <name> value" message


def _number_or_mapping(hint: Any) -> bool:
    """Whether a field's type is a union of a number and a mapping without ``str`` (sentence-transformers'
    ``MultiVectorEncoderTrainingArguments.max_length``: ``int | None | dict[str, int]``), which
    ``HfArgumentParser`` refuses (one type per flag)."""
    args = get_args(hint)
    return (
        get_origin(hint) in (Union, types.UnionType)
        and str not in args
        and int in args
        and any(get_origin(a) is dict or a is dict for a in args)
    )


def _int_or_json(text: str) -> Any:
    """A flag's text as an integer, or as a JSON mapping (``{"query": 32, "document": 180}``)."""
    with contextlib.suppress(ValueError):
        return int(text)
    with contextlib.suppress(ValueError):  # json.JSONDecodeError is a ValueError
        if isinstance(value := json.loads(text), dict):
            return value
    raise argparse.ArgumentTypeError(f"{text!r} is neither an integer nor a JSON mapping")


_int_or_json.__name__ = "integer or JSON mapping"  # argparse's "invalid <name> value" message


class CachedLossArgumentParser(HfArgumentParser):
    """``HfArgumentParser`` for [`CachedLossTrainingArguments`][st_cached_losses.training_args.CachedLossTrainingArguments] (or
    the sparse / multi-vector arguments classes) and a script's own dataclasses, with closest-name errors, the
    loss fields first in ``--help``, and configuration files plus overrides.

    Args:
        dataclass_types: the dataclasses to fill, in the order the parse methods return them (default:
            ``CachedLossTrainingArguments`` alone; ``CachedSparseEncoderTrainingArguments`` for 'sparse',
            ``CachedMultiVectorEncoderTrainingArguments`` for 'multi_vector').
        kwargs: passed to ``argparse.ArgumentParser`` (e.g. ``description=__doc__``).
    """

    def __init__(
        self,
        dataclass_types: Any = CachedLossTrainingArguments,  # a dataclass type or several
        **kwargs: Any,
    ) -> None:
        kwargs.setdefault("formatter_class", _HelpFormatter)
        kwargs.setdefault("usage", USAGE)
        if kwargs.get("description"):  # a script's docstring: --help is plain text
            kwargs["description"] = plain_text(kwargs["description"])
        self._loss_group: Any = None  # the loss fields' --help section, created with the first dataclass
        # the training arguments' help texts and their sections' descriptions, which --help leaves out (it names
        # the ~120 fields only) and --help_all shows
        self._brief_help: dict[argparse.Action, str | None] = {}
        self._brief_groups: dict[Any, str | None] = {}
        super().__init__(dataclass_types, **kwargs)
        if "--help_all" not in self._option_string_actions:
            self.add_argument(
                "--help_all",
                action=_HelpAllAction,
                help="show this help with every training argument described, and exit",
            )

    # ------------------------------------------------------------------ fields

    @property
    def field_names(self) -> list[str]:
        """Every field the parser fills, in order."""
        return [f.name for dtype in self.dataclass_types for f in dataclasses.fields(dtype) if f.init]

    def check_keys(self, keys: Iterable[str], source: str | os.PathLike[Any] | None = None) -> None:
        """Raise a ``ValueError`` naming the closest field for every key no dataclass has.

        Args:
            keys: field names, e.g. the keys of a configuration file.
            source: where they come from, for the message (a file name).
        """
        known = self.field_names
        unknown = sorted(set(keys) - set(known))
        if unknown:
            hints = "".join(field_hint(key, known) for key in unknown)
            where = f"{source}: " if source is not None else ""
            raise ValueError(f"{where}unknown field(s) {unknown}; see --help for the fields.{hints}")

    def _add_dataclass_arguments(self, dtype: type) -> None:
        """One ``--help`` section per dataclass; for the arguments class, its loss fields in a section of
        their own that comes before every other (they are what a user of this package came to set)."""
        try:
            hints = get_type_hints(dtype)
        except NameError as err:
            raise RuntimeError(
                f"the annotations of {dtype.__name__} could not be resolved ({err}): define the dataclass at "
                "module level, with the names of its annotations imported."
            ) from err
        owner = next((d for d in self.dataclass_types if issubclass(d, CachedLossArguments)), None)
        if self._loss_group is None and owner is not None:
            # titled by the arguments class that holds the loss fields, whichever dataclass comes first
            self._loss_group = self.add_argument_group(
                f"cached loss ({owner.__name__})",
                "The loss and its hyperparameters; every training argument below can be set as well.",
            )
        fields = [f for f in dataclasses.fields(dtype) if f.init]
        if issubclass(dtype, CachedLossArguments):
            # the model kind's own arguments class (SentenceTransformerTrainingArguments, ...), then transformers'
            kind = next(b for b in dtype.__mro__[1:] if b.__module__.startswith("sentence_transformers"))
            rest = self.add_argument_group(f"training ({kind.__name__}, TrainingArguments)")
            groups = [
                (self._loss_group, [f for f in fields if f.name in LOSS_FIELDS]),
                (rest, [f for f in fields if f.name not in LOSS_FIELDS]),
            ]
        else:
            doc = (dtype.__doc__ or "").strip()
            generated = doc.startswith(f"{dtype.__name__}(")  # what dataclasses write for no docstring
            title = getattr(dtype, "_argument_group_name", dtype.__name__)
            description = None if generated else plain_text(doc.split("\n\n")[0])
            groups = [(self.add_argument_group(title, description), fields)]
        for group, group_fields in groups:
            for f in group_fields:
                converter = (
                    _count_or_auto
                    if f.name in COUNT_OR_AUTO_FIELDS
                    else _count_or_all
                    if f.name in COUNT_OR_ALL_FIELDS
                    else None
                )
                if _number_or_mapping(hints[f.name]):
                    # argparse takes one type per flag: parsed from its text here (a copy of the field, so
                    # that the dataclass's own stays as declared)
                    f, converter = copy.copy(f), _int_or_json
                    f.type = Optional[str]  # noqa: UP045  # HfArgumentParser reads typing's form
                else:
                    f.type = hints[f.name]
                self._parse_dataclass_field(group, f)
                for action in (a for a in group._group_actions if a.dest == f.name):
                    if converter is not None:
                        action.type = converter
                    if action.help:
                        action.help = plain_text(action.help)
                    if isinstance(action, argparse._StoreFalseAction):  # HfArgumentParser's --no_<field>
                        action.help = f"Turn off {f.name}: the same as --{f.name} false."
                    if f.name == "multi_dataset_batch_sampler" and issubclass(dtype, CachedLossArguments):
                        # the arguments turn it into SameDatasetBatchSampler
                        action.choices = [*(action.choices or ()), SAME_DATASET]
                        action.help = (
                            f"{action.help} '{SAME_DATASET}': SameDatasetBatchSampler, every process trains on "
                            "the same dataset in each step (see same_dataset_order, same_dataset_per_optimizer_step)."
                        )
        if issubclass(dtype, CachedLossArguments):
            self._name_only(rest, [f.name for f in groups[1][1] if f.name not in DESCRIBED_TRAINING_FIELDS])

    def _name_only(self, group: Any, names: list[str]) -> None:
        """``--help`` describes the training arguments of ``group`` a run sets most
        (``DESCRIBED_TRAINING_FIELDS``) and names the others in a paragraph (their help texts, transformers' and
        sentence-transformers', ran to some 650 lines); ``--help_all`` describes each."""
        self._brief_groups[group] = group.description
        for action in group._group_actions:
            if action.dest in names:
                self._brief_help[action] = action.help
                action.help = argparse.SUPPRESS
        flags = textwrap.fill(", ".join(f"--{name}" for name in names), width=100)
        classes = group.title.split("(", 1)[1].rstrip(")").replace(", ", " and ")
        group.description = (
            f"The fields of {classes} a run sets most are described below; every other one is named here "
            f"(--help_all describes each):\n{flags}"
        )

    # ------------------------------------------------------------------ parsing

    def parse_dict(self, args: Mapping[str, Any], allow_extra_keys: bool = False) -> tuple[Any, ...]:
        """Like ``HfArgumentParser.parse_dict``, but an unknown key (unless ``allow_extra_keys``) is an
        error naming the closest field, raised before any dataclass is built."""
        if not allow_extra_keys:
            self.check_keys(args)
        return super().parse_dict(dict(args), allow_extra_keys=allow_extra_keys)

    def parse_yaml_file(
        self, yaml_file: str | os.PathLike[Any], allow_extra_keys: bool = False
    ) -> tuple[Any, ...]:
        """The dataclasses from a YAML file; an unknown key is an error naming the file and the closest field."""
        return self._parse_file(yaml_file, allow_extra_keys)

    def parse_json_file(
        self, json_file: str | os.PathLike[Any], allow_extra_keys: bool = False
    ) -> tuple[Any, ...]:
        """The dataclasses from a JSON file; an unknown key is an error naming the file and the closest field."""
        return self._parse_file(json_file, allow_extra_keys)

    def _parse_file(self, path: str | os.PathLike[Any], allow_extra_keys: bool) -> tuple[Any, ...]:
        data = load_config(path)
        if not allow_extra_keys:
            self.check_keys(data, source=path)
        return super().parse_dict(data, allow_extra_keys=allow_extra_keys)

    def parse_args_into_dataclasses(
        self,
        args: Any = None,
        return_remaining_strings: Any = False,
        look_for_args_file: Any = True,
        args_filename: Any = None,
        args_file_flag: Any = None,
    ) -> tuple[Any, ...]:
        """Like ``HfArgumentParser.parse_args_into_dataclasses``, but an unknown flag is an error naming
        the closest field, raised before any dataclass is built."""
        if not return_remaining_strings:
            _, remaining = self.parse_known_args(args=None if args is None else list(args))
            if remaining:
                flag = remaining[0]
                hint = field_hint(flag.lstrip("-").split("=")[0].replace("-", "_"), self.field_names)
                raise ValueError(
                    f"unknown command-line argument(s) {remaining}; see --help for the fields."
                    + (hint if flag.startswith("--") else "")
                )
        return super().parse_args_into_dataclasses(
            args=args,
            return_remaining_strings=return_remaining_strings,
            look_for_args_file=look_for_args_file,
            args_filename=args_filename,
            args_file_flag=args_file_flag,
        )

    def parse_command_line(
        self, argv: Sequence[str] | None = None, defaults: Mapping[str, Any] | None = None
    ) -> tuple[Any, ...]:
        """A script's arguments: its ``defaults``, then a configuration file, then command-line flags.

        Accepted forms:

        ```text
        script.py --loss clip --per_device_train_batch_size 1024 ...
        script.py run.yaml                            # or run.json: the file over the defaults
        script.py --config run.yaml --max_steps 10    # the file, then command-line overrides
        ```

        Args:
            argv: the arguments; default ``sys.argv[1:]``.
            defaults: values that replace the dataclasses' own defaults (a script's tiny CPU defaults).

        Returns:
            One instance per dataclass, in order.

        Raises:
            ValueError: for an unknown field (naming the closest one) or an invalid value, when ``argv``
                is given. With ``argv=None`` (a command line) the error is printed as one ``error:`` line
                and the process exits with status 2, as argparse does.
        """
        try:
            return self._parse_command_line(list(sys.argv[1:] if argv is None else argv), defaults or {})
        except ValueError as err:
            if argv is not None:
                raise
            self.exit(2, f"{self.prog}: error: {err}\n")

    def _parse_command_line(self, argv: list[str], defaults: Mapping[str, Any]) -> tuple[Any, ...]:
        self.check_keys(defaults, source="defaults")
        values = dict(defaults)
        config, argv = _split_config(argv)
        if config is not None:
            from_file = load_config(config)
            self.check_keys(from_file, source=config)
            values = _merge(values, from_file)
        values = copy.deepcopy(values)  # the parsed arguments must not share a dict or list with `defaults`
        self.set_defaults(**values)  # before --help is printed: it shows the script's and the file's values
        # an alternative of a field the command line sets goes back to its own default (None for scale and
        # temperature), so `--scale 30` replaces a temperature from the defaults or the file
        dropped = set(values) - set(_merge(values, dict.fromkeys(self._fields_given(argv))))
        if dropped:
            fields = {f.name: f for d in self.dataclass_types for f in dataclasses.fields(d) if f.init}
            self.set_defaults(**{name: _field_default(fields[name]) for name in dropped})
        return self.parse_args_into_dataclasses(args=argv, look_for_args_file=False)

    def _fields_given(self, argv: list[str]) -> set[str]:
        """The fields ``argv`` sets (abbreviated flags included): parsed into a namespace whose every
        field already holds a marker, argparse leaves the others at the marker."""
        marker = object()
        namespace = argparse.Namespace(**dict.fromkeys(self.field_names, marker))
        parsed, _ = self.parse_known_args(args=argv, namespace=namespace)
        return {name for name in self.field_names if getattr(parsed, name, marker) is not marker}


def _split_config(argv: list[str]) -> tuple[str | None, list[str]]:
    """The configuration file ``argv`` names (``--config PATH``, ``--config=PATH`` or a first argument
    ending in .yaml / .yml / .json), and the other arguments."""
    for i, token in enumerate(argv):
        if token.startswith("--config="):
            return token.split("=", 1)[1], argv[:i] + argv[i + 1 :]
        if token == "--config":
            if i + 1 >= len(argv) or argv[i + 1].startswith("-"):
                raise ValueError("--config needs a path to a .yaml, .yml or .json file.")
            return argv[i + 1], argv[:i] + argv[i + 2 :]
    if argv and argv[0].endswith(CONFIG_SUFFIXES) and not argv[0].startswith("-"):
        return argv[0], argv[1:]
    return None, argv


def _merge(lower: Mapping[str, Any], higher: Mapping[str, Any]) -> dict[str, Any]:
    """``higher`` over ``lower``; a field of [`ALTERNATIVE_FIELDS`][st_cached_losses.config.cli.ALTERNATIVE_FIELDS] set in ``higher`` also drops its
    alternatives from ``lower`` (a temperature on the command line replaces the defaults' scale)."""
    merged = dict(lower)
    for group in ALTERNATIVE_FIELDS:
        if any(name in higher for name in group):
            for name in group:
                if name not in higher:
                    merged.pop(name, None)
    merged.update(higher)
    return merged


def _field_default(f: dataclasses.Field) -> Any:
    """The value a dataclass field gets when it is not given."""
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None if f.default is dataclasses.MISSING else f.default

"""The configuration as command-line flags: ``--preset`` and one flag per field of
:class:`collage.train.config.Config`, its help the field's ``help`` metadata; explicit
flags override the preset. Malformed values raise :class:`collage.errors.UsageError`
naming the flag."""

from __future__ import annotations

import argparse
import dataclasses
import os
import types
import typing
from typing import Any

from ..errors import UsageError
from .config import SECTIONS, Config, flag_name
from .presets import PRESETS, get_preset

__all__ = ["add_config_flags", "config_from_args"]



def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _base(tp: Any) -> tuple[Any, bool]:
    """``(T, optional)`` for ``T`` or ``T | None``."""
    args = typing.get_args(tp)
    if (typing.get_origin(tp) in (typing.Union, types.UnionType)) and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return rest[0], True
    return tp, False


def _convert(text: str, tp: Any, flag: str) -> Any:
    """Parse one flag value; malformed input raises UsageError naming the flag."""
    base, optional = _base(tp)
    if optional and text.strip().lower() in ("none", "null", ""):
        return None
    if base is bool:
        low = text.strip().lower()
        if low in ("1", "true", "yes", "on"):
            return True
        if low in ("0", "false", "no", "off"):
            return False
        raise UsageError(f"{flag}: expected true or false, got {text!r}")
    if base is int:
        try:
            value = float(text)
        except ValueError:
            raise UsageError(f"{flag}: expected an integer, got {text!r}") from None
        if not value.is_integer():
            raise UsageError(f"{flag}: expected an integer, got {text!r}")
        return int(value)
    if base is float:
        try:
            return float(text)
        except ValueError:
            raise UsageError(f"{flag}: expected a number, got {text!r}") from None
    return text


def add_config_flags(parser: argparse.ArgumentParser, command: str,
                     sections: tuple[str, ...] | None = None) -> None:
    """Add ``--preset`` and one flag per config field (those meant for ``command``; of the
    given ``sections`` only, when given)."""
    parser.add_argument("--preset", default=argparse.SUPPRESS, metavar="NAME",
                        help="starting configuration: " + ", ".join(PRESETS)
                        + " (default: quick); flags override it")
    for section, cls in SECTIONS.items():
        if sections is not None and section not in sections:
            continue
        group = parser.add_argument_group(section, cls.__doc__.strip())
        hints = _hints(cls)
        for f in dataclasses.fields(cls):
            commands = f.metadata.get("commands") or ()
            if commands and command not in commands:
                continue
            flag, tp = flag_name(f), hints[f.name]
            base, optional = _base(tp)
            choices = f.metadata.get("choices")
            default = f.default
            shown = ",".join(map(str, default)) if isinstance(default, tuple) else default
            shown = "none" if shown is None else ("-" if shown == () else shown)
            help_text = f"{f.metadata['help']} (default: {shown})"
            dest = f"{section}.{f.name}"
            if base is bool and not optional:
                parser_group = group
                parser_group.add_argument(flag, dest=dest, default=argparse.SUPPRESS,
                                          action=argparse.BooleanOptionalAction,
                                          help=f.metadata["help"] + f" (default: {default})")
            elif typing.get_origin(base) is tuple:
                group.add_argument(flag, dest=dest, default=argparse.SUPPRESS, nargs="+",
                                   metavar="X", help=help_text + "; space or comma separated")
            else:
                metavar = ("{" + ",".join(choices) + "}") if choices else (
                    f.metadata.get("metavar") or {int: "N", float: "X", bool: "BOOL"}.get(
                        base, "TEXT"))
                group.add_argument(flag, dest=dest, default=argparse.SUPPRESS,
                                   metavar=metavar, help=help_text)


def config_from_args(args: argparse.Namespace, command: str) -> Config:
    """The preset named by ``--preset`` (default quick) with every given flag applied."""
    config = get_preset(getattr(args, "preset", "quick"))
    changes: dict[str, dict[str, Any]] = {}
    for section, cls in SECTIONS.items():
        hints = _hints(cls)
        for f in dataclasses.fields(cls):
            dest = f"{section}.{f.name}"
            if not hasattr(args, dest):
                continue
            raw, flag, tp = getattr(args, dest), flag_name(f), hints[f.name]
            if isinstance(raw, bool):
                value: Any = raw
            elif isinstance(raw, list):  # tuple field, nargs="+"
                items = [x for part in raw for x in part.split(",") if x.strip()]
                item_type = typing.get_args(tp)[0]
                value = tuple(_convert(x.strip(), item_type, flag) for x in items)
            else:
                value = _convert(raw, tp, flag)
            changes.setdefault(section, {})[f.name] = value
    given_run = changes.get("run", {})
    if "beta2" in changes.get("optim", {}) and "beta2s" not in given_run:
        # --beta2 on the command line overrides the preset's beta2 sweep, as any flag
        # overrides its preset's value (--beta2s, given too, overrides --beta2)
        changes.setdefault("run", {})["beta2s"] = ()
    config = config.replace(**changes)
    _check_learning_rate_sweep(config, given_run)
    _check_flags_take_effect(config, changes, command)
    return config


def _check_learning_rate_sweep(config: Config, given_run: dict[str, Any]) -> None:
    """--lrs given on the command line must reach a run: refused where none of
    --lrs-strategies is compared (a preset's own sweep may name strategies left out)."""
    run = config.run
    if ("lrs" in given_run and run.lrs_strategies
            and not set(run.lrs_strategies) & set(run.strategy_list())):
        raise UsageError(f"--lrs: none of --lrs-strategies ({', '.join(run.lrs_strategies)}) "
                         f"is compared ({', '.join(run.strategy_list())}), so no run would use "
                         "it; name a compared strategy in --lrs-strategies, or leave it out")


def _check_flags_take_effect(config: Config, changes: dict[str, dict[str, Any]],
                             command: str) -> None:
    """A flag given on the command line that the run would not use is refused, naming what
    it needs (a preset's own values are not checked: they are defaults, not requests)."""
    data, given_data = config.data, changes.get("data", {})
    for name in ("dataset_config", "dataset_split", "text_column"):
        if name in given_data and data.dataset is None:
            raise UsageError(f"--{name.replace('_', '-')}: applies to --dataset, which is not "
                             "given")
    if "dataset_config" in given_data and data.dataset and os.path.exists(data.dataset):
        raise UsageError(f"--dataset-config: {data.dataset!r} is a local file or directory; "
                         "a configuration name applies to a Hugging Face hub dataset, leave "
                         "it out")
    if "vocab_size" in given_data and data.tokenizer == "bytes":
        raise UsageError("--vocab-size: applies to --tokenizer bpe (the bytes tokenizer has "
                         "its 257 ids)")
    if "mlm_probability" in given_data and config.model.family != "bert":
        raise UsageError(f"--mlm-probability: only the masked LM (--family bert) masks "
                         f"tokens; this run's family is {config.model.family}")
    given_run = changes.get("run", {})
    if (command == "compare" and given_run.get("checkpoint_every")
            and not config.run.resume):
        raise UsageError("--checkpoint-every: compare keeps its runs' checkpoints only with "
                         "--resume; add --resume, or leave it out")

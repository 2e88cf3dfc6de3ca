"""Read a YAML config file into an OmegaConf layer; every way a file can be wrong is one line.

A missing file, a directory, binary or non-UTF-8 content, a YAML syntax error, a duplicate
key and a top level that is not a mapping of sections all raise :class:`ConfigError` naming
the file (and the line where YAML knows it).
"""

from __future__ import annotations

import os

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from bebop_megatron.config.errors import ConfigError


def read_config_file(path: str) -> DictConfig:
    if os.path.isdir(path):
        raise ConfigError(f"config file {path} is a directory; give a YAML file (see examples/configs/)")
    try:
        layer = OmegaConf.load(path)
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except UnicodeDecodeError as err:
        raise ConfigError(f"config file {path} is not UTF-8 text (byte {err.start}); give a YAML file") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"config file {path}: {_yaml_problem(err)}") from None
    except (OSError, OmegaConfBaseException) as err:
        raise ConfigError(f"config file {path}: cannot read it ({type(err).__name__}: {_first_line(err)})") from None
    if not isinstance(layer, DictConfig):
        kind = "a list" if OmegaConf.is_list(layer) else type(layer).__name__
        raise ConfigError(f"config file {path}: the top level is {kind}; it must be a mapping of sections "
                          "(device, model, train, ...)")
    return layer


def default_save_dir(path: str) -> str:
    """``save.dir`` of a run given ``--config PATH`` whose file does not set it."""
    stem = os.path.splitext(os.path.basename(os.path.normpath(path)))[0]
    return os.path.join("checkpoints", stem)


def _yaml_problem(err: yaml.YAMLError) -> str:
    problem = getattr(err, "problem", None)
    mark = getattr(err, "problem_mark", None) or getattr(err, "context_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    if problem and "duplicate key" in problem:
        return f"{problem}{where} (each key may appear once per section)"
    if isinstance(err, yaml.reader.ReaderError):
        char = f"{err.character:#04x}" if isinstance(err.character, int) else f"{ord(err.character):#04x}"
        return f"not a text YAML file (control character {char} at position {err.position})"
    return f"invalid YAML{where}: {problem or _first_line(err)}"


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__
